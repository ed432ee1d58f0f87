// The registry: every backend this build knows, registered once, here. A backend defines its
// record (runtime/backend.h) beside its engine; adding one is its file and a line below.
#include <stdexcept>
#include <string>

#include "runtime/backend.h"
#include "runtime/null/null_engine.h"
#if TRAINSIM_HAVE_CUDA
#include "runtime/cuda/cuda_engine.h"
#endif

namespace trainsim::runtime {

namespace {

#if !TRAINSIM_HAVE_CUDA
// What `--backend cuda` finds in a build without nvcc: a record that says why it cannot run.
const Backend& cuda_backend() {
  static const Backend backend{
      .name = "cuda",
      .title = "CUDA",
      .help = "cuBLAS, our kernels; NCCL under a launcher (not in this build)",
      .unavailable = "this trainsim was built without CUDA (no nvcc at configure time); use --backend cpu",
      .launched = true,
  };
  return backend;
}
#else
using cuda::cuda_backend;
#endif

}  // namespace

const std::vector<const Backend*>& backends() {
  static const std::vector<const Backend*> all = {
      &cpu_backend(),   // runtime/cpu/cpu_engine.cpp
      &cuda_backend(),  // runtime/cuda/cuda_engine.cpp
      &null_backend(),  // runtime/null/null_engine.cpp
  };
  return all;
}

const Backend& find_backend(const std::string& name) {
  std::string names;
  for (const Backend* b : backends()) {
    if (b->name == name) return *b;
    names += (names.empty() ? "" : ", ") + b->name;
  }
  throw std::invalid_argument("no backend named '" + name + "'; this build has " + names);
}

}  // namespace trainsim::runtime
