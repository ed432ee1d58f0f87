// Number formats shared by every text report (simulate, sweep, plan, run), so the same
// figure reads the same everywhere.
#pragma once

#include <string>

#include "core/general6.h"  // write_general6, the CSV reports' numbers

namespace trainsim {

// 12.7K, 1.35B: three significant figures with a K/M/B/T suffix.
std::string human_count(double x);
// 2.581 s, 14.50 ms, 3.2 us.
std::string format_seconds(double s);
// 11.3 days, 5.2 hours, 14.0 minutes, or format_seconds below two minutes.
std::string format_duration(double s);
// "#####....." : `fraction` of `width` characters filled.
std::string text_bar(double fraction, int width);
// Rounded to 6 significant digits, as every JSON report writes figures: stable and readable.
double round6(double x);

}  // namespace trainsim
