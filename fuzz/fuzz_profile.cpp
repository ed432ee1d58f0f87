// Hardware profiles (core/hardware_profile.h): the YAML `trainsim calibrate` writes and a
// scenario names with `cluster.profile: FILE`. Whatever bytes such a file holds:
//   * load_profile_text loads them or throws std::runtime_error whose message starts with the
//     file's name (never another exception, a crash, undefined behaviour or a leak);
//   * a profile that loads can be used as the cost models use it (apply_profile, kernel and
//     collective times at any size and group size) without undefined behaviour;
//   * what profile_to_yaml writes for it loads again (a profile trainsim wrote is one it reads).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "core/config.h"
#include "core/hardware_profile.h"

namespace {

constexpr const char* kName = "fuzz-profile.yaml";

void require(bool ok, const char* what, const std::string& detail = "") {
  if (ok) return;
  std::fprintf(stderr, "fuzz_profile: property violated: %s %s\n", what, detail.c_str());
  std::abort();
}

// A time the cost models can turn into ticks: finite and not negative.
bool a_time(double s) { return std::isfinite(s) && s >= 0; }

void use(const trainsim::HardwareProfile& p) {
  trainsim::ClusterConfig cluster;
  trainsim::apply_profile(p, cluster);
  for (const trainsim::KernelRate& k : p.kernels) {
    require(std::isfinite(k.rate()) && k.rate() >= 0, "a kernel's rate is finite, >= 0");
    const double t = p.kernel_seconds(k.kernel, k.dtype, k.shape, k.bytes);
    require(a_time(t) || t == -1, "kernel_seconds is a time (or -1: not measured)");
    trainsim::KernelShape other = k.shape;
    other.k = other.k / 2 + 1;  // another shape of the same kernel: priced from the nearest
    const double u = p.kernel_seconds(k.kernel, k.dtype, other, k.bytes / 3 + 1);
    require(a_time(u) || u == -1, "kernel_seconds at another shape is a time (or -1)");
  }
  for (trainsim::DType d : trainsim::kAllDTypes) require(std::isfinite(p.best_matmul_tflops(d)), "best rate finite");
  for (int n = 0; n <= 9; ++n)
    for (double bytes : {0.0, 1.0, 4096.0, 1e9}) {
      require(a_time(p.allreduce_seconds(n, bytes)), "allreduce_seconds is a time");
      require(a_time(p.allgather_seconds(n, bytes)), "allgather_seconds is a time");
      require(a_time(p.reduce_scatter_seconds(n, bytes)), "reduce_scatter_seconds is a time");
    }
  for (double bytes : {0.0, 1.0, 4096.0, 1e9}) require(a_time(p.p2p_seconds(bytes)), "p2p_seconds is a time");
  for (int r = 0; r < 3; ++r) {
    require(p.core_factor(r) > 0, "core factors are positive");
    require(p.optimizer_core_factor(r) > 0, "optimizer core factors are positive");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  trainsim::HardwareProfile p;
  try {
    p = trainsim::load_profile_text(text, kName);
  } catch (const std::runtime_error& e) {
    require(std::string(e.what()).rfind(kName, 0) == 0, "an error names the file:", e.what());
    return 0;
  }
  use(p);
  const std::string written = trainsim::profile_to_yaml(p);
  try {
    use(trainsim::load_profile_text(written, kName));
  } catch (const std::runtime_error& e) {
    require(false, "a profile trainsim wrote loads again:", std::string(e.what()) + "\n" + written);
  }
  return 0;
}
