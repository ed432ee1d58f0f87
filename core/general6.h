// x as printf's "%.6g" (fmt's "{:.6g}", and "{:g}") writes it, at a fraction of their cost:
// the reports' number format (CSV) and the text of a real field value (format_field_value).
#pragma once

#include <string>

namespace trainsim {

// Writes at most kGeneral6Chars characters from `out` and returns the end.
inline constexpr int kGeneral6Chars = 32;
char* write_general6(char* out, double x);
void append_general6(std::string& out, double x);

}  // namespace trainsim
