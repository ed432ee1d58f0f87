#include "core/config.h"

namespace trainsim {

std::string_view schedule_name(ScheduleKind s) {
  switch (s) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved_1f1b: return "interleaved-1f1b";
    case ScheduleKind::zb_h1: return "zb-h1";
  }
  return "?";
}

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::selective: return "selective";
    case Recompute::full: return "full";
    case Recompute::selective_op: return "selective_op";
  }
  return "?";
}

std::string_view runtime_backend_name(RuntimeBackend b) { return b == RuntimeBackend::cuda ? "cuda" : "cpu"; }

}  // namespace trainsim
