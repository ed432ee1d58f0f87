// write_general6: the text of printf's "%.6g" (and fmt's "{:.6g}"), without their cost.
//
// The six significant digits are the value scaled by a power of ten and rounded to an
// integer. The scaling is one long-double operation (64-bit mantissa) by a power of ten it
// holds exactly (10^0 .. 10^27), so the scaled value is within 2^-64 of the true one,
// relatively: about 1e-13 at most for a value below 10^6. The rounding it decides is then
// exact unless the true value lies that close to a half (a tie, or nearly one), and those
// values, as zero, infinities, NaN and magnitudes outside 1e-22 .. 1e27, are left to
// std::to_chars, which gives printf's text exactly (tests/test_report.cpp compares the two
// on millions of values, ties and near-ties among them).
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/general6.h"

namespace trainsim {

namespace {

constexpr int kMaxPower = 27;  // 10^27 = 2^27 * 5^27, and 5^27 < 2^63: exact in a long double
const long double* powers_of_ten() {
  static const auto table = [] {
    struct Table {
      long double p[kMaxPower + 1];
    } t{};
    long double x = 1;
    for (int k = 0; k <= kMaxPower; ++k, x *= 10) t.p[k] = x;
    return t;
  }();
  return table.p;
}

char* fallback(char* out, char* end, double x) {
  return std::to_chars(out, end, x, std::chars_format::general, 6).ptr;
}

}  // namespace

char* write_general6(char* out, double x) {
  char* const limit = out + kGeneral6Chars;
  if (!std::isfinite(x) || x == 0) return fallback(out, limit, x);
  const double a = std::fabs(x);
  if (!(a >= 1e-22 && a < 1e27)) return fallback(out, limit, x);
  const long double* p10 = powers_of_ten();
  // X: the decimal exponent, a's in [10^X, 10^(X+1)); y = a * 10^(5 - X) in [10^5, 10^6).
  // First from the binary exponent (log10(2) = 0.30103), then corrected by y's range.
  std::uint64_t bits = 0;
  std::memcpy(&bits, &a, sizeof bits);
  const int e2 = static_cast<int>(bits >> 52) - 1023;  // a in [2^e2, 2^(e2 + 1)): a is normal here
  int X = e2 * 30103 / 100000 - (e2 < 0 ? 1 : 0);   // floor(e2 * log10(2)), within one
  long double y = 0;
  for (int tries = 0;; ++tries) {
    const int k = 5 - X;
    if (k > kMaxPower || -k > kMaxPower || tries > 2) return fallback(out, limit, x);
    y = k >= 0 ? static_cast<long double>(a) * p10[k] : static_cast<long double>(a) / p10[-k];
    if (y < 100000.0L) {
      --X;
    } else if (y >= 1000000.0L) {
      ++X;
    } else {
      break;
    }
  }
  const auto whole = static_cast<std::int64_t>(y);  // y > 0: truncation is the floor
  const long double frac = y - static_cast<long double>(whole);
  if (std::fabs(frac - 0.5L) < 1e-9L) return fallback(out, limit, x);  // a tie, or too near one to tell
  std::int64_t n = whole + (frac > 0.5L ? 1 : 0);
  if (n == 1000000) {  // rounded up to the next power of ten
    n = 100000;
    ++X;
  }
  char digits[6];
  for (int i = 5; i >= 0; --i) {
    digits[i] = static_cast<char>('0' + n % 10);
    n /= 10;
  }
  int sig = 6;  // trailing zeros are not written
  while (sig > 1 && digits[sig - 1] == '0') --sig;
  char* p = out;
  if (x < 0) *p++ = '-';
  if (X >= -4 && X < 6) {  // fixed
    if (X >= 0) {
      for (int i = 0; i <= X; ++i) *p++ = digits[i];
      if (sig > X + 1) {
        *p++ = '.';
        for (int i = X + 1; i < sig; ++i) *p++ = digits[i];
      }
    } else {
      *p++ = '0';
      *p++ = '.';
      for (int i = 0; i < -X - 1; ++i) *p++ = '0';
      for (int i = 0; i < sig; ++i) *p++ = digits[i];
    }
  } else {  // scientific: d.ddddde+XX
    *p++ = digits[0];
    if (sig > 1) {
      *p++ = '.';
      for (int i = 1; i < sig; ++i) *p++ = digits[i];
    }
    *p++ = 'e';
    *p++ = X < 0 ? '-' : '+';
    const int e = X < 0 ? -X : X;
    if (e >= 100) *p++ = static_cast<char>('0' + e / 100);
    *p++ = static_cast<char>('0' + e / 10 % 10);
    *p++ = static_cast<char>('0' + e % 10);
  }
  return p;
}

void append_general6(std::string& out, double x) {
  char buf[kGeneral6Chars];
  out.append(buf, write_general6(buf, x));
}

}  // namespace trainsim
