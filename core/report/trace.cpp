#include "core/report/report.h"
namespace trainsim {
void write_chrome_trace(const Plan&, const Timeline&, std::ostream&) { throw std::runtime_error("trace: being written"); }
}
