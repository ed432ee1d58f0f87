#include "runtime/cpu/core_account.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace trainsim::runtime {

namespace {

std::int64_t clock_ns(clockid_t c) {
  timespec t{};
  clock_gettime(c, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// The number in a small sysfs file, or nothing.
std::optional<std::int64_t> read_number(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return std::nullopt;
  long long x = 0;
  const bool ok = std::fscanf(f, "%lld", &x) == 1;
  std::fclose(f);
  return ok ? std::optional<std::int64_t>(x) : std::nullopt;
}

}  // namespace

std::int64_t thread_cpu_ns() { return clock_ns(CLOCK_THREAD_CPUTIME_ID); }
std::int64_t wall_ns() { return clock_ns(CLOCK_MONOTONIC); }

std::optional<std::int64_t> cpu_idle_us(int cpu) {
  const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/cpuidle/state";
  std::int64_t total = 0;
  int states = 0;
  for (int k = 0;; ++k, ++states) {
    const std::optional<std::int64_t> t = read_number(base + std::to_string(k) + "/time");
    if (!t) break;
    total += *t;
  }
  return states > 0 ? std::optional<std::int64_t>(total) : std::nullopt;
}

bool CoreAccount::open(int cpu) {
  if (sched_getcpu() != cpu) return false;  // not pinned there (a pin the system refused)
  const std::optional<std::int64_t> idle = cpu_idle_us(cpu);
  if (!idle) return false;
  cpu_ = cpu;
  idle_us_ = *idle;
  cpu_ns_ = thread_cpu_ns();
  wall_ = wall_ns();
  return true;
}

std::optional<CoreAccount::Window> CoreAccount::close() const {
  if (cpu_ < 0 || sched_getcpu() != cpu_) return std::nullopt;  // read elsewhere, the idle time is not exact
  const std::optional<std::int64_t> idle = cpu_idle_us(cpu_);  // first: the caller runs here now
  if (!idle) return std::nullopt;
  return Window{wall_ns() - wall_, (*idle - idle_us_) * 1000, thread_cpu_ns() - cpu_ns_};
}

std::int64_t CoreAccount::Window::other_work(std::int64_t other_threads_cpu_ns) const {
  return std::max<std::int64_t>(0, wall - idle - own - other_threads_cpu_ns);
}

std::vector<std::int64_t> HostAccount::idle_on_every_core() {
  cpu_set_t allowed;
  if (pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) != 0) return {};
  std::vector<std::int64_t> idle;
  int visited = 0;
  for (int c = 0; c < CPU_SETSIZE && visited < CPU_COUNT(&allowed); ++c) {
    if (!CPU_ISSET(c, &allowed)) continue;
    ++visited;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(c, &one);
    // The call moves the calling thread to `c` before it returns.
    if (pthread_setaffinity_np(pthread_self(), sizeof(one), &one) != 0 || sched_getcpu() != c) break;
    const std::optional<std::int64_t> t = cpu_idle_us(c);
    if (!t) break;
    idle.push_back(*t);
  }
  pthread_setaffinity_np(pthread_self(), sizeof(allowed), &allowed);
  if (static_cast<int>(idle.size()) != CPU_COUNT(&allowed)) idle.clear();
  return idle;
}

bool HostAccount::open() {
  idle_us_ = idle_on_every_core();
  if (idle_us_.empty()) return false;
  process_cpu_ = clock_ns(CLOCK_PROCESS_CPUTIME_ID);
  wall_ = wall_ns();
  return true;
}

std::optional<std::int64_t> HostAccount::other_work_ns() const {
  if (idle_us_.empty()) return std::nullopt;
  // In open()'s order (the cores' idle time, then the process's time, then the clock), so that
  // the visit of every core, which can wait milliseconds for a busy core, lies outside both
  // windows alike: read the other way round, the cores' idle time during the visit fell in the
  // idle window and not in the wall one, and counted as less work (an other process's whole 168
  // ms seen as 162 in a loaded CI run).
  const std::vector<std::int64_t> idle = idle_on_every_core();
  const std::int64_t process = clock_ns(CLOCK_PROCESS_CPUTIME_ID) - process_cpu_;
  const std::int64_t wall = wall_ns() - wall_;
  if (idle.size() != idle_us_.size()) return std::nullopt;
  std::int64_t busy = 0;
  for (std::size_t c = 0; c < idle.size(); ++c) busy += wall - (idle[c] - idle_us_[c]) * 1000;
  return std::max<std::int64_t>(0, busy - process);
}

}  // namespace trainsim::runtime
