#include "core/report/write_file.h"

#include <cstdio>
#include <fstream>
#include <stdexcept>

#include <fmt/format.h>

namespace trainsim {

void write_file(const std::string& path, const std::function<void(std::ostream&)>& body) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    if (!out) throw std::runtime_error(fmt::format("cannot write {} (does the folder exist?)", path));
    body(out);
    out.flush();
    if (!out) throw std::runtime_error(fmt::format("writing {} failed", path));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error(fmt::format("cannot rename {} to {}", tmp, path));
}

}  // namespace trainsim
