#include "core/report/svg_kit.h"

#include <string>

#include <fmt/format.h>

namespace trainsim::svg {

std::string escape(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default: o += c;
    }
  return o;
}

std::string open(double width, double height, bool view_box, std::string_view attributes) {
  return fmt::format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0:.0f}\" height=\"{1:.0f}\"{2}{3}>\n", width,
                     height, view_box ? fmt::format(" viewBox=\"0 0 {:.0f} {:.0f}\"", width, height) : "", attributes);
}

std::optional<Size> size_of(std::string_view document) {
  const auto root = document.find("<svg");
  if (root == std::string_view::npos) return std::nullopt;
  const std::string_view tag = document.substr(root, document.find('>', root) - root);
  const auto w = tag.find(" width=\""), h = tag.find(" height=\"");
  if (w == std::string_view::npos || h == std::string_view::npos) return std::nullopt;
  try {
    return Size{std::stod(std::string(tag.substr(w + 8))), std::stod(std::string(tag.substr(h + 9)))};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::string nested(std::string_view document, std::optional<double> y) {
  const auto root = document.find("<svg");
  if (root == std::string_view::npos) return std::string(document);
  if (!y) return std::string(document.substr(root));
  return fmt::format("<svg x=\"0\" y=\"{:.0f}\"", *y) + std::string(document.substr(root + 4));
}

}  // namespace trainsim::svg
