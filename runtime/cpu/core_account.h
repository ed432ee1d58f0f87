// What a rank's core did during a step: the wall time, less what the rank's own threads ran there
// and the time the core sat idle, is time the host gave that core to other work (another process,
// the kernel's own threads, time the hypervisor took from the vCPU). Where ranks share the cores,
// the same over every core and the whole process (HostAccount). On the 2-vCPU guest
// of docs/validation.md the kernel's memory compaction and reclaim threads ran up to 50 ms at a
// time: a step they fall in is the machine's noise, not the plan's (runtime/loop/run_loop.h,
// median_step_index).
#pragma once

#include <pthread.h>
#include <time.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace trainsim::runtime {

// The calling thread's CPU time so far, ns.
std::int64_t thread_cpu_ns();
// The monotonic clock, ns.
std::int64_t wall_ns();
// Logical CPU `cpu`'s idle time so far, us: the kernel's cpuidle residency over all its states
// (/sys/devices/system/cpu/cpuN/cpuidle/stateK/time). Exact while the caller runs on `cpu` (an idle
// stretch is added when it ends); nothing where the kernel publishes no cpuidle states.
std::optional<std::int64_t> cpu_idle_us(int cpu);

// One core's account over a window, opened and closed by a thread running on that core (pinned).
class CoreAccount {
 public:
  // What the window held, in ns: its wall time, the core's idle time in it and the CPU time of the
  // thread that opened and closed it.
  struct Window {
    std::int64_t wall = 0, idle = 0, own = 0;
    // Other work on the core: the wall time less the idle time, the closing thread's CPU time and
    // `other_threads_cpu_ns` (the rest of what the rank ran on the core); at least 0.
    std::int64_t other_work(std::int64_t other_threads_cpu_ns) const;
  };
  // Opens the window on `cpu`, the caller's core; false (and nothing counted) where the core's idle
  // time is not published or the caller is not running on it (a pin the system refused).
  bool open(int cpu);
  // The window so far; nothing when it was not opened, the idle time could not be read or the
  // caller has left the core.
  std::optional<Window> close() const;

 private:
  int cpu_ = -1;
  std::int64_t wall_ = 0, idle_us_ = 0, cpu_ns_ = 0;
};

// Every core's account over a window, for a process whose threads are not pinned: other work is
// the cores' wall time less their idle time less this process's CPU time (all its threads). The
// calling thread visits each core to read its idle time there (a core's idle time is exact only
// while something runs on it), then goes back to the cores it was allowed before.
class HostAccount {
 public:
  // Opens the window; false (nothing counted) where the cores' idle time is not published or the
  // thread cannot visit them.
  bool open();
  // Nanoseconds of other work on all the cores since open(), at least 0; nothing when not opened.
  std::optional<std::int64_t> other_work_ns() const;

 private:
  // Each core's idle time now, us, read on that core; empty where it cannot be.
  static std::vector<std::int64_t> idle_on_every_core();
  std::vector<std::int64_t> idle_us_;
  std::int64_t wall_ = 0, process_cpu_ = 0;
};

}  // namespace trainsim::runtime
