// The SVG toolkit every picture of trainsim is written with (the timeline, core/report/svg.cpp;
// the sweep chart, sim/sweep/report.cpp; the run's timeline over its loss curve,
// runtime/loop/run_report.cpp; the predicted-over-measured stack of validation): escaping text,
// the root element, and one document placed inside another. Coordinates are the callers' (each
// writes them with a fixed number of decimals, so the same input gives a byte-identical file).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace trainsim::svg {

// Text and attribute values as XML wants them: & < > " ' escaped.
std::string escape(std::string_view text);

// The root element of a document of `width` x `height` pixels, with a viewBox of the same size when
// `view_box`, then `attributes` (" font-size=\"12\"", written as given), and a newline:
//   <svg xmlns="http://www.w3.org/2000/svg" width="1400" height="400" viewBox="0 0 1400 400" ...>
std::string open(double width, double height, bool view_box, std::string_view attributes = "");
inline constexpr std::string_view kClose = "</svg>\n";

// The size a whole document's root element says (its first width="..." and height="..."), or
// nullopt when it says none.
struct Size {
  double width = 0, height = 0;
};
std::optional<Size> size_of(std::string_view document);

// A whole document as an element of another: its XML prolog dropped and, when `y` is given, its
// root placed at (0, y) by x and y attributes.
std::string nested(std::string_view document, std::optional<double> y = std::nullopt);

}  // namespace trainsim::svg
