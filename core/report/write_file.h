// Writing a report file whole or not at all: through a temporary file beside it, renamed
// over the target once complete, so a failed write never leaves half a file.
#pragma once

#include <functional>
#include <ostream>
#include <string>

namespace trainsim {

// Throws std::runtime_error naming the path when the file cannot be written.
void write_file(const std::string& path, const std::function<void(std::ostream&)>& body);

}  // namespace trainsim
