// The CUDA kernels' speed (kernels/kernels.h, kernels/gemm.h), on the device:
//  * every kernel at the runtime's shape (tests/bench/cpu-step.yaml's model) and at a
//    GPT-2-small shape (B 8, T 1024, C 768, 12 heads, vocabulary 50304), with fp32 and bf16
//    storage, timed with CUDA events (manual time). Counters: bytes (the least traffic the kernel
//    must move to and from memory: each input read once, each output written once),
//    bytes_per_s, fraction_of_hbm against the device's peak, 2 x memory clock x bus width
//    (kernels/device_buffer.h), and fraction_of_copy against a device-to-device cudaMemcpy of
//    1 GiB measured in the same run (bytes read + written): the bandwidth a memory-bound kernel
//    can reach (target >= 0.8 at the GPT-2 shape). Kernels whose data fit in L2 (the runtime
//    shape) can exceed 1. fraction_of_same_size_copy: a copy of the kernel's own bytes, timed the
//    same way, over the kernel's time: what is left once the start and the last wave every launch
//    of that size pays are taken out (a 25 MB kernel takes ~8 us of bytes and a few more of those);
//  * matrix products at the model's shapes in fp32, tf32, fp16 and bf16: tflops, and, with the
//    bias the layers add, fraction_of_cublas: cuBLAS's plain product of the same shape and type
//    (no bias) timed in the same run, over ours (linear_forward with its bias epilogue);
//  * a product beside SMs held by a stand-in for a collective (BM_GemmBesideHeldSms), and FP8
//    products against BF16 ones of the same shape (BM_ProductByFormat): for the simulator's
//    figures (docs/validation.md, fidelity: the torchtitan rows).
// Without a CUDA device every benchmark reports "no CUDA device" (SkipWithError).
//
//   build/tests/bench/bench_kernels --benchmark_min_time=0.2
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kernels/device_buffer.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "tests/bench/sm_holder.h"

namespace {

using namespace trainsim;
using namespace trainsim::cuda;

struct Shape {
  const char* name;
  int B, T, C, H, V, layers;
  int N() const { return B * T; }
  // GPT-2 parameters: embeddings, per block 12 C^2 + 13 C, final LayerNorm (tied LM head).
  std::size_t params() const {
    const std::size_t c = C;
    return std::size_t(V) * c + std::size_t(T) * c + std::size_t(layers) * (12 * c * c + 13 * c) + 2 * c;
  }
};
const Shape kShapes[] = {
    {"runtime", 8, 128, 256, 8, 256, 8},    // tests/bench/cpu-step.yaml
    {"gpt2", 8, 1024, 768, 12, 50304, 12},  // GPT-2 small, vocabulary padded to a multiple of 64
};
const DType kStorage[] = {DType::fp32, DType::bf16};
const DType kGemmTypes[] = {DType::fp32, DType::tf32, DType::fp16, DType::bf16};

std::string label(DType d) { return std::string(dtype_name(d)); }
double bytes_of(DType d) { return dtype_bytes(d); }  // tf32 is stored as fp32

struct DeviceState {
  bool ok = false;
  std::string why;
  DeviceMemoryInfo memory;
};
const DeviceState& device() {
  static const DeviceState d = [] {
    DeviceState s;
    s.ok = device_available(&s.why);
    if (s.ok) s.memory = device_memory_info(0);
    return s;
  }();
  return d;
}

// n elements of `dt`, normal(0, sd): a 1M-element pattern drawn on the host, tiled on the device.
DeviceBuffer random_buffer(DType dt, std::size_t n, float sd, std::uint32_t seed) {
  const std::size_t chunk = std::min<std::size_t>(n, std::size_t(1) << 20);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> host(chunk);
  for (float& x : host) x = nd(rng);
  DeviceBuffer pattern(chunk * 4), out(n * static_cast<std::size_t>(bytes_of(dt)));
  pattern.upload(host.data(), chunk * 4);
  for (std::size_t off = 0; off < n; off += chunk)
    cast(out.as<std::uint8_t>() + off * static_cast<std::size_t>(bytes_of(dt)), dt, pattern.data(), DType::fp32,
         std::min(chunk, n - off), nullptr);
  synchronize();
  return out;
}

DeviceBuffer random_ids(std::size_t n, int V, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> ud(0, V - 1);
  std::vector<std::int32_t> host(n);
  for (auto& x : host) x = ud(rng);
  DeviceBuffer d(n * 4);
  d.upload(host.data(), n * 4);
  return d;
}

DeviceBuffer constant_floats(std::size_t n, float value) {
  std::vector<float> host(n, value);
  DeviceBuffer d(n * 4);
  d.upload(host.data(), n * 4);
  return d;
}

// Median seconds of `reps` launches on `stream`, each timed with CUDA events, after one warm-up.
template <class Launch>
double median_seconds(const Stream& stream, int reps, Launch&& launch) {
  launch();
  stream.synchronize();
  EventTimer timer;
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    timer.start(stream.get());
    launch();
    timer.stop(stream.get());
    t.push_back(timer.elapsed_seconds());
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[static_cast<std::size_t>(reps / 2)];
}

// Bytes per second of a 1 GiB device-to-device cudaMemcpy (read + written), measured once.
double copy_bandwidth() {
  static const double bw = [] {
    const std::size_t bytes = std::size_t(1) << 30;
    DeviceBuffer a(bytes), b(bytes);
    Stream st;
    return 2.0 * static_cast<double>(bytes) /
           median_seconds(st, 11, [&] { copy_device_to_device(b.data(), a.data(), bytes, st.get()); });
  }();
  return bw;
}

// Seconds of a device-to-device cudaMemcpy that moves `bytes` (half read, half written), measured
// once per size: what any launch that moves these bytes pays, its start and its last wave
// included, where the 1 GiB copy's bandwidth is what long streams reach.
double same_size_copy_seconds(double bytes) {
  static std::map<std::size_t, double> measured;
  const std::size_t half = std::max<std::size_t>(256, static_cast<std::size_t>(bytes / 2) / 256 * 256);
  auto it = measured.find(half);
  if (it == measured.end()) {
    DeviceBuffer a(half), b(half);
    Stream st;
    it = measured.emplace(half, median_seconds(st, 21, [&] { copy_device_to_device(b.data(), a.data(), half, st.get()); }))
             .first;
  }
  return it->second;
}

// Times `launch` on `stream` with CUDA events, one measurement per iteration (after one warm-up
// launch), and reports bandwidth for `bytes` moved per launch (and flops when given).
// Returns the mean seconds per launch.
template <class Launch>
double run_timed(benchmark::State& state, const Stream& stream, double bytes, double flops, Launch&& launch) {
  launch();
  stream.synchronize();
  EventTimer timer;
  double total = 0;
  for (auto _ : state) {
    timer.start(stream.get());
    launch();
    timer.stop(stream.get());
    const double s = timer.elapsed_seconds();
    state.SetIterationTime(s);
    total += s;
  }
  const double per_s = static_cast<double>(state.iterations()) / total;
  if (bytes > 0) {
    state.counters["bytes"] = bytes;
    state.counters["bytes_per_s"] = bytes * per_s;
    state.counters["fraction_of_hbm"] = bytes * per_s / device().memory.peak_bandwidth_bytes_per_s;
    state.counters["fraction_of_copy"] = bytes * per_s / copy_bandwidth();
    state.counters["fraction_of_same_size_copy"] = same_size_copy_seconds(bytes) * per_s;
  }
  if (flops > 0) state.counters["tflops"] = flops * per_s * 1e-12;
  return 1.0 / per_s;
}

// The common frame: skip without a device, read the arguments, label, catch launcher errors.
template <class Body>
void with_device(benchmark::State& state, Body&& body) {
  if (!device().ok) {
    state.SkipWithError("no CUDA device");
    return;
  }
  try {
    // As the CUDA backend runs them: scratch from a default pool that keeps its memory.
    static const bool pool_kept = (keep_default_pool_memory(0), true);
    (void)pool_kept;
    body();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

const Shape& shape_arg(const benchmark::State& state) { return kShapes[state.range(0)]; }
DType storage_arg(const benchmark::State& state) { return kStorage[state.range(1)]; }
void set_label(benchmark::State& state, const Shape& s, DType dt) {
  state.SetLabel(std::string(s.name) + " " + label(dt) + " (peak " +
                 std::to_string(static_cast<int>(device().memory.peak_bandwidth_bytes_per_s * 1e-9)) + " GB/s)");
}

void StorageArgs(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < 2; ++s)
    for (int d = 0; d < 2; ++d) b->Args({s, d});
}

// ---------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------
void BM_EmbeddingForward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t nc = std::size_t(s.N()) * s.C;
    auto wte = random_buffer(dt, std::size_t(s.V) * s.C, 0.02f, 1),
         wpe = random_buffer(dt, std::size_t(s.T) * s.C, 0.02f, 2);
    auto tok = random_ids(s.N(), s.V, 3);
    DeviceBuffer out(nc * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    run_timed(state, st, 3.0 * nc * bytes_of(dt) + 4.0 * s.N(), 0, [&] {
      embedding_forward(out.data(), tok.as<std::int32_t>(), wte.data(), wpe.data(), s.B, s.T, s.C, s.V, dt, st.get());
    });
  });
}
BENCHMARK(BM_EmbeddingForward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_EmbeddingBackward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t nc = std::size_t(s.N()) * s.C;
    auto dout = random_buffer(dt, nc, 1.0f, 4), tok = random_ids(s.N(), s.V, 5);
    auto dwte = random_buffer(DType::fp32, std::size_t(s.V) * s.C, 0.01f, 6);
    auto dwpe = random_buffer(DType::fp32, std::size_t(s.T) * s.C, 0.01f, 7);
    Stream st;
    const double touched_rows = std::min(s.N(), s.V) + s.T;  // read and written in fp32
    run_timed(state, st, nc * bytes_of(dt) + 8.0 * touched_rows * s.C + 4.0 * s.N(), 0, [&] {
      embedding_backward(dwte.as<float>(), dwpe.as<float>(), dout.data(), tok.as<std::int32_t>(), s.B, s.T, s.C, s.V,
                         dt, st.get());
    });
  });
}
BENCHMARK(BM_EmbeddingBackward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_LayerNormForward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t nc = std::size_t(s.N()) * s.C;
    auto x = random_buffer(dt, nc, 1.0f, 8), g = random_buffer(dt, s.C, 1.0f, 9), b = random_buffer(dt, s.C, 1.0f, 10);
    DeviceBuffer out(nc * static_cast<std::size_t>(bytes_of(dt))), mean(s.N() * 4), rstd(s.N() * 4);
    Stream st;
    run_timed(state, st, 2.0 * nc * bytes_of(dt) + 8.0 * s.N(), 0, [&] {
      layernorm_forward(out.data(), mean.as<float>(), rstd.as<float>(), x.data(), g.data(), b.data(), s.N(), s.C, dt,
                        st.get());
    });
  });
}
BENCHMARK(BM_LayerNormForward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_LayerNormBackwardInput(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t nc = std::size_t(s.N()) * s.C;
    auto x = random_buffer(dt, nc, 1.0f, 11), dy = random_buffer(dt, nc, 1.0f, 12),
         g = random_buffer(dt, s.C, 1.0f, 13);
    auto dres = random_buffer(dt, nc, 1.0f, 14);
    auto mean = constant_floats(s.N(), 0.0f), rstd = constant_floats(s.N(), 1.0f);
    DeviceBuffer dx(nc * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    run_timed(state, st, 4.0 * nc * bytes_of(dt) + 8.0 * s.N(), 0, [&] {
      layernorm_backward_input(dx.data(), dy.data(), x.data(), mean.as<float>(), rstd.as<float>(), g.data(),
                               dres.data(), s.N(), s.C, dt, st.get());
    });
  });
}
BENCHMARK(BM_LayerNormBackwardInput)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_LayerNormBackwardWeight(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t nc = std::size_t(s.N()) * s.C;
    auto x = random_buffer(dt, nc, 1.0f, 15), dy = random_buffer(dt, nc, 1.0f, 16);
    auto mean = constant_floats(s.N(), 0.0f), rstd = constant_floats(s.N(), 1.0f);
    auto dg = constant_floats(s.C, 0.0f), db = constant_floats(s.C, 0.0f);
    Stream st;
    run_timed(state, st, 2.0 * nc * bytes_of(dt) + 8.0 * s.N() + 16.0 * s.C, 0, [&] {
      layernorm_backward_weight(dg.as<float>(), db.as<float>(), dy.data(), x.data(), mean.as<float>(), rstd.as<float>(),
                                s.N(), s.C, dt, st.get());
    });
  });
}
BENCHMARK(BM_LayerNormBackwardWeight)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_BiasBackward(benchmark::State& state) {  // the qkv projection's bias (3C columns)
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const int oc = 3 * s.C;
    auto dy = random_buffer(dt, std::size_t(s.N()) * oc, 1.0f, 17);
    auto db = constant_floats(oc, 0.0f);
    Stream st;
    run_timed(state, st, double(s.N()) * oc * bytes_of(dt) + 8.0 * oc, 0,
              [&] { bias_backward(db.as<float>(), dy.data(), s.N(), oc, dt, st.get()); });
  });
}
BENCHMARK(BM_BiasBackward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_GeluForward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = std::size_t(s.N()) * 4 * s.C;
    auto x = random_buffer(dt, n, 1.0f, 18);
    DeviceBuffer y(n * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    run_timed(state, st, 2.0 * n * bytes_of(dt), 0, [&] { gelu_forward(y.data(), x.data(), n, dt, st.get()); });
  });
}
BENCHMARK(BM_GeluForward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_GeluBackward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = std::size_t(s.N()) * 4 * s.C;
    auto x = random_buffer(dt, n, 1.0f, 19), dy = random_buffer(dt, n, 1.0f, 20);
    DeviceBuffer dx(n * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    run_timed(state, st, 3.0 * n * bytes_of(dt), 0,
              [&] { gelu_backward(dx.data(), x.data(), dy.data(), n, dt, st.get()); });
  });
}
BENCHMARK(BM_GeluBackward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

// Causal: the rows read only keys j <= i (half of each matrix), and write every element.
void BM_CausalSoftmaxForward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const int bh = s.B * s.H;
    const std::size_t n = std::size_t(bh) * s.T * s.T;
    auto scores = random_buffer(dt, n, 2.0f, 21);
    DeviceBuffer probs(n * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    const double tri = double(bh) * s.T * (s.T + 1) / 2.0;
    run_timed(state, st, (tri + double(n)) * bytes_of(dt), 0,
              [&] { causal_softmax_forward(probs.data(), scores.data(), bh, s.T, 1.0f, dt, st.get()); });
  });
}
BENCHMARK(BM_CausalSoftmaxForward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_CausalSoftmaxBackward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const int bh = s.B * s.H;
    const std::size_t n = std::size_t(bh) * s.T * s.T;
    auto probs = random_buffer(dt, n, 0.01f, 22), dprobs = random_buffer(dt, n, 1.0f, 23);
    DeviceBuffer ds(n * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    const double tri = double(bh) * s.T * (s.T + 1) / 2.0;
    run_timed(state, st, (2.0 * tri + double(n)) * bytes_of(dt), 0,
              [&] { causal_softmax_backward(ds.data(), probs.data(), dprobs.data(), bh, s.T, 0.125f, dt, st.get()); });
  });
}
BENCHMARK(BM_CausalSoftmaxBackward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_CrossEntropyForward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = std::size_t(s.N()) * s.V;
    auto logits = random_buffer(dt, n, 2.0f, 24), targets = random_ids(s.N(), s.V, 25);
    DeviceBuffer losses(s.N() * 4), lse(s.N() * 4);
    Stream st;
    run_timed(state, st, n * bytes_of(dt) + 12.0 * s.N(), 0, [&] {
      cross_entropy_forward(losses.as<float>(), lse.as<float>(), logits.data(), targets.as<std::int32_t>(), s.N(), s.V,
                            dt, st.get());
    });
  });
}
BENCHMARK(BM_CrossEntropyForward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_CrossEntropyBackward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = std::size_t(s.N()) * s.V;
    auto logits = random_buffer(dt, n, 2.0f, 26), targets = random_ids(s.N(), s.V, 27);
    auto lse = constant_floats(s.N(), 12.0f);
    DeviceBuffer dlogits(n * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    run_timed(state, st, 2.0 * n * bytes_of(dt) + 8.0 * s.N(), 0, [&] {
      cross_entropy_backward(dlogits.data(), logits.data(), lse.as<float>(), targets.as<std::int32_t>(), s.N(), s.V,
                             1.0f / s.N(), dt, st.get());
    });
  });
}
BENCHMARK(BM_CrossEntropyBackward)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_ResidualAdd(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = std::size_t(s.N()) * s.C;
    auto a = random_buffer(dt, n, 1.0f, 28), b = random_buffer(dt, n, 1.0f, 29);
    DeviceBuffer out(n * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    run_timed(state, st, 3.0 * n * bytes_of(dt), 0,
              [&] { residual_add(out.data(), a.data(), b.data(), n, dt, st.get()); });
  });
}
BENCHMARK(BM_ResidualAdd)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

// The optimizer step's kernels over the whole model's parameters (one stage holding all layers).
void BM_CastMasterToWorking(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = s.params();
    auto master = random_buffer(DType::fp32, n, 0.02f, 30);
    DeviceBuffer working(n * static_cast<std::size_t>(bytes_of(dt)));
    Stream st;
    run_timed(state, st, n * (4.0 + bytes_of(dt)), 0,
              [&] { cast(working.data(), dt, master.data(), DType::fp32, n, st.get()); });
  });
}
BENCHMARK(BM_CastMasterToWorking)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_UnscaleAndCheck(benchmark::State& state) {  // gradients in the accumulation format
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = s.params();
    auto grads = random_buffer(dt, n, 1.0f, 31);
    DeviceBuffer flag(sizeof(int));
    fill_zero(flag.data(), sizeof(int));
    Stream st;
    // inv_scale 1 keeps the values unchanged from one iteration to the next.
    run_timed(state, st, 2.0 * n * bytes_of(dt), 0,
              [&] { unscale_and_check(grads.data(), n, 1.0f, flag.as<int>(), dt, st.get()); });
  });
}
BENCHMARK(BM_UnscaleAndCheck)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_SquaredNorm(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = s.params();
    auto grads = random_buffer(dt, n, 1.0f, 32);
    DeviceBuffer out(8), scratch(kReductionScratchDoubles * 8);
    Stream st;
    run_timed(state, st, n * bytes_of(dt), 0,
              [&] { squared_norm(out.as<double>(), grads.data(), n, dt, scratch.as<double>(), false, st.get()); });
  });
}
BENCHMARK(BM_SquaredNorm)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

// AdamW: reads master, m, v (fp32), the gradient (fp32 here) and the decay mask; writes master,
// m, v and the working copy in the storage format.
void BM_AdamW(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = shape_arg(state);
    const DType dt = storage_arg(state);
    set_label(state, s, dt);
    const std::size_t n = s.params();
    auto master = random_buffer(DType::fp32, n, 0.02f, 33), grads = random_buffer(DType::fp32, n, 0.01f, 34);
    DeviceBuffer m(n * 4), v(n * 4), mask(n), working(n * static_cast<std::size_t>(bytes_of(dt)));
    fill_zero(m.data(), n * 4);
    fill_zero(v.data(), n * 4);
    fill_zero(mask.data(), n);
    Stream st;
    AdamParams p;
    run_timed(state, st, n * (3 * 4.0 + 4.0 + 1.0 + 3 * 4.0 + bytes_of(dt)), 0, [&] {
      adam_update(master.as<float>(), m.as<float>(), v.as<float>(), grads.data(), DType::fp32, mask.as<std::uint8_t>(),
                  working.data(), dt, n, p, st.get());
    });
  });
}
BENCHMARK(BM_AdamW)->Apply(StorageArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);

// ---------------------------------------------------------------------------------------
// Matrix products: the forward of each linear layer at the model's shapes.
// ---------------------------------------------------------------------------------------
struct Linear {
  const char* name;
  int in_mult, out_mult;  // in = in_mult * C, out = out_mult * C (0: the vocabulary)
};
const Linear kLinears[] = {{"qkv", 1, 3}, {"attn.proj", 1, 1}, {"mlp.fc", 1, 4}, {"mlp.proj", 4, 1}, {"lm_head", 1, 0}};

void GemmArgs(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < 2; ++s)
    for (int d = 0; d < 4; ++d)
      for (int l = 0; l < 5; ++l) b->Args({s, d, l});
}

// The reference for the products: the device-to-device copy (memory-bound kernels' ceiling).
void BM_DeviceToDeviceCopy(benchmark::State& state) {
  with_device(state, [&] {
    const std::size_t bytes = std::size_t(1) << 30;
    DeviceBuffer a(bytes), b(bytes);
    Stream st;
    state.SetLabel("1 GiB cudaMemcpyAsync, bytes read + written");
    run_timed(state, st, 2.0 * static_cast<double>(bytes), 0,
              [&] { copy_device_to_device(b.data(), a.data(), bytes, st.get()); });
  });
}
BENCHMARK(BM_DeviceToDeviceCopy)->UseManualTime()->Unit(benchmark::kMicrosecond);

void BM_LinearForward(benchmark::State& state) {
  with_device(state, [&] {
    const Shape& s = kShapes[state.range(0)];
    const DType dt = kGemmTypes[state.range(1)];
    const Linear& lin = kLinears[state.range(2)];
    const int in = lin.in_mult * s.C, out = lin.out_mult ? lin.out_mult * s.C : s.V, N = s.N();
    const DType st_dt = dt == DType::tf32 ? DType::fp32 : dt;
    state.SetLabel(std::string(s.name) + " " + label(dt) + " " + lin.name + " (" + std::to_string(N) + " x " +
                   std::to_string(in) + " -> " + std::to_string(out) + ")");
    auto x = random_buffer(st_dt, std::size_t(N) * in, 1.0f, 40),
         w = random_buffer(st_dt, std::size_t(out) * in, 0.02f, 41);
    auto b = random_buffer(st_dt, std::size_t(out), 0.02f, 42);
    DeviceBuffer y(std::size_t(N) * out * static_cast<std::size_t>(bytes_of(st_dt)));
    Stream st;
    GemmContext ctx(st.get());
    // cuBLAS's own product of this shape and type, no bias: the reference.
    const double reference = median_seconds(st, 21, [&] {
      gemm(ctx, false, true, N, out, in, 1.0f, x.data(), in, w.data(), in, 0.0f, y.data(), out, dt, st_dt);
    });
    const double ours = run_timed(state, st, 0, 2.0 * N * in * out, [&] {
      linear_forward(ctx, y.data(), x.data(), w.data(), b.data(), N, in, out, dt);
    });
    state.counters["fraction_of_cublas"] = reference / ours;
  });
}
BENCHMARK(BM_LinearForward)->Apply(GemmArgs)->UseManualTime()->Unit(benchmark::kMicrosecond);


// ---------------------------------------------------------------------------------------
// Compute beside a collective: a product while `held` SMs run a stand-in for a collective's
// channels (tests/bench/sm_holder.h: one block per SM, copying through HBM), against the same
// product alone. What the simulator would price a product at while its rank's collectives run
// beside it (docs/validation.md, the torchtitan rows' 8- and 128-GPU gap): NCCL holds an SM per
// channel for a collective's whole duration.
// ---------------------------------------------------------------------------------------
struct Product {
  const char* name;
  int m, n, k;
};
const Product kBesideProducts[] = {{"8192 x 4096 x 4096 (attention projection, 8k tokens)", 8192, 4096, 4096},
                                   {"8192 x 14336 x 4096 (SwiGLU up, Llama 3 8B)", 8192, 14336, 4096}};
const int kHeldSms[] = {0, 8, 16, 24, 32};

void BM_GemmBesideHeldSms(benchmark::State& state) {
  with_device(state, [&] {
    const Product& p = kBesideProducts[state.range(0)];
    const int held = kHeldSms[state.range(1)];
    const DType dt = DType::bf16;
    state.SetLabel(std::string(p.name) + " bf16, " + std::to_string(held) + " of " +
                   std::to_string(device().memory.multiprocessors) + " SMs held");
    auto a = random_buffer(dt, std::size_t(p.m) * p.k, 1.0f, 60), b = random_buffer(dt, std::size_t(p.n) * p.k, 0.02f, 61);
    DeviceBuffer c(std::size_t(p.m) * p.n * 2);
    Stream products, collective;
    GemmContext ctx(products.get());
    auto product = [&] {
      gemm(ctx, false, true, p.m, p.n, p.k, 1.0f, a.data(), p.k, b.data(), p.k, 0.0f, c.data(), p.n, dt, dt);
    };
    const double alone = median_seconds(products, 11, product);
    // The holder copies 64 MiB over and over for well past the products timed beside it: its passes
    // at its share of the SMs' part of the copy bandwidth, eight times over to be sure it outlasts
    // them (a block may move more than its share).
    constexpr int kProducts = 10;
    const std::size_t bytes = std::size_t(64) << 20;
    DeviceBuffer src(bytes), dst(bytes);
    const double share = held > 0 ? static_cast<double>(held) / std::max(1, device().memory.multiprocessors) : 0;
    const int passes =
        held > 0 ? std::max(1, static_cast<int>(8.0 * kProducts * alone * share * copy_bandwidth() / (2.0 * bytes)) + 1) : 0;
    EventTimer timer;
    double total = 0;
    for (auto _ : state) {
      bench::hold_sms_copying(dst.data(), src.data(), bytes, held, passes, collective.get());
      timer.start(products.get());
      for (int i = 0; i < kProducts; ++i) product();
      timer.stop(products.get());
      const double each = timer.elapsed_seconds() / kProducts;
      collective.synchronize();
      state.SetIterationTime(each);
      total += each;
    }
    const double mean = total / static_cast<double>(state.iterations());
    state.counters["slowdown"] = mean / alone;
    state.counters["sm_share_held"] = share;
    state.counters["tflops"] = 2.0 * p.m * p.n * p.k / mean * 1e-12;
  });
}
BENCHMARK(BM_GemmBesideHeldSms)
    ->ArgsProduct({{0, 1}, {0, 1, 2, 3, 4}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// ---------------------------------------------------------------------------------------
// What an FP8 product reaches against a BF16 one of the same shape: Llama 3 8B's layer products
// at torchtitan's 16,384 tokens a rank (local batch 2 x 8,192) and FBGEMM's 8192^3, in BF16
// (cuBLAS) and in FP8 E4M3 with tensor-wise scales (cuBLASLt, gemm_fp8: the product torchao's
// Float8Linear runs), with and without fast accumulation (torchao's forward product uses it, its
// backward ones do not). The simulator prices an FP8 product at twice the BF16 peak with the same
// efficiency (docs/presets.md); the torchtitan rows' BF16 and Float8 8B rows disagree by ~8% under
// one clock (docs/validation.md, fidelity), which this ratio, measured, decides between. Counters:
// tflops, bf16_tflops (the same shape in BF16, timed in the same run), over_bf16.
// ---------------------------------------------------------------------------------------
const Product kFormatProducts[] = {{"8192 x 8192 x 8192 (FBGEMM's)", 8192, 8192, 8192},
                                   {"16384 x 4096 x 4096 (wq, wo)", 16384, 4096, 4096},
                                   {"16384 x 1024 x 4096 (wk, wv)", 16384, 1024, 4096},
                                   {"16384 x 14336 x 4096 (w1, w3)", 16384, 14336, 4096},
                                   {"16384 x 4096 x 14336 (w2)", 16384, 4096, 14336}};
const char* const kProductFormats[] = {"bf16", "fp8", "fp8 fast accumulation"};

// n FP8 E4M3 codes of magnitude 2^-6 to 15, either sign (no NaN): a 1 MiB pattern tiled.
DeviceBuffer random_e4m3(std::size_t n, std::uint32_t seed) {
  const std::size_t chunk = std::min<std::size_t>(n, std::size_t(1) << 20);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exponent(1, 10), mantissa(0, 7), sign(0, 1);
  std::vector<std::uint8_t> host(chunk);
  for (auto& c : host) c = static_cast<std::uint8_t>(sign(rng) << 7 | exponent(rng) << 3 | mantissa(rng));
  DeviceBuffer out(n);
  Stream st;
  DeviceBuffer pattern(chunk);
  pattern.upload(host.data(), chunk);
  for (std::size_t off = 0; off < n; off += chunk)
    copy_device_to_device(out.as<std::uint8_t>() + off, pattern.data(), std::min(chunk, n - off), st.get());
  st.synchronize();
  return out;
}

void BM_ProductByFormat(benchmark::State& state) {
  with_device(state, [&] {
    const Product& p = kFormatProducts[state.range(0)];
    const int format = static_cast<int>(state.range(1));
    state.SetLabel(std::string(p.name) + " " + kProductFormats[format]);
    const double flops = 2.0 * p.m * p.n * p.k;
    Stream st;
    GemmContext ctx(st.get());
    DeviceBuffer c(std::size_t(p.m) * p.n * 2);
    double bf16_seconds = 0;
    {
      auto a = random_buffer(DType::bf16, std::size_t(p.m) * p.k, 1.0f, 70),
           b = random_buffer(DType::bf16, std::size_t(p.n) * p.k, 0.02f, 71);
      auto product = [&] {
        gemm(ctx, false, true, p.m, p.n, p.k, 1.0f, a.data(), p.k, b.data(), p.k, 0.0f, c.data(), p.n, DType::bf16,
             DType::bf16);
      };
      if (format == 0) {
        run_timed(state, st, 0, flops, product);
        return;
      }
      bf16_seconds = median_seconds(st, 11, product);
    }
    auto a = random_e4m3(std::size_t(p.m) * p.k, 72), b = random_e4m3(std::size_t(p.n) * p.k, 73);
    auto scales = constant_floats(2, 1.0f);
    const double seconds = run_timed(state, st, 0, flops, [&] {
      gemm_fp8(ctx, p.m, p.n, p.k, a.data(), b.data(), scales.as<float>(), scales.as<float>() + 1, c.data(),
               DType::bf16, format == 2);
    });
    state.counters["bf16_tflops"] = flops / bf16_seconds * 1e-12;
    state.counters["over_bf16"] = bf16_seconds / seconds;
  });
}
BENCHMARK(BM_ProductByFormat)->ArgsProduct({{0, 1, 2, 3, 4}, {0, 1, 2}})->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
