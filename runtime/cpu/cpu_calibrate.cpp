// The CPU backend's calibration (cpu_calibrate.h): every kernel timed with the runtime's own
// implementation of it (runtime/model/layers.h, runtime/numerics/), on a thread pinned to core 0.
#include "runtime/cpu/cpu_calibrate.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <deque>
#include <fstream>
#include <functional>
#include <exception>
#include <memory>
#include <mutex>
#include <numbers>
#include <random>
#include <span>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/kernel_inventory.h"
#include "core/median.h"
#include "runtime/comm/in_process.h"
#include "runtime/cpu/core_gate.h"
#include "runtime/cpu/cpu_engine.h"
#include "runtime/engine/world.h"
#include "runtime/model/layers.h"
#include "runtime/model/stage_model.h"
#include "runtime/model/model_parallel.h"
#include "runtime/model/stage_layout.h"
#include "runtime/numerics/lowp.h"
#include "runtime/numerics/optimizer.h"
#include "runtime/numerics/splitmix64.h"

namespace trainsim::runtime {

namespace {

using Clock = std::chrono::steady_clock;

// Operands for timing: random, finite and of the given spread, not exactly normal. Each value is
// the sum of four 16-bit uniforms of one splitmix64 draw (Irwin-Hall), centred and scaled to
// standard deviation `scale` (|x| < 3.5 scale). std::normal_distribution took 10% of a
// calibration's CPU time filling the buffers that must exceed the last-level cache; this takes
// 3-6 ns a value against 18-30 (page faults included; Xeon VM, one core beside another job).
std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  SplitMix64 draws((std::uint64_t{rng()} << 32) | rng());
  // Each 16-bit uniform has mean 32767.5 and variance (2^32 - 1) / 12: the sum's variance is 2^32 / 3.
  const float unit = scale * std::numbers::sqrt3_v<float> / 65536.0f;
  std::vector<float> v(std::max<std::size_t>(n, 1));
  for (float& x : v) {
    const std::uint64_t z = draws.next();
    const std::uint64_t sum = (z & 0xFFFF) + ((z >> 16) & 0xFFFF) + ((z >> 32) & 0xFFFF) + (z >> 48);
    x = static_cast<float>(static_cast<std::int32_t>(sum) - 131070) * unit;  // exact: |sum - mean| < 2^24
  }
  return v;
}

// Times one kernel of the inventory with the runtime's implementation of it.
// A kernel that meets data a step touches once (written long before, or kept from the last step)
// is timed from memory: each launch works on the next of enough copies of its buffers, `bytes`
// each, to exceed twice the last-level cache. Returns a callable handing out the copies in turn.
template <class Copy, class Make>
auto copies_past_cache(std::size_t bytes, Make&& make) {
  const std::size_t count = std::max<std::size_t>(2, (2 * last_level_cache_bytes() + bytes - 1) / std::max<std::size_t>(1, bytes));
  auto copies = std::make_shared<std::vector<Copy>>();
  for (std::size_t c = 0; c < count; ++c) copies->push_back(make());
  return [copies, next = std::make_shared<std::size_t>(0)]() -> Copy& { return (*copies)[(*next)++ % copies->size()]; };
}

class KernelTimer {
 public:
  KernelTimer(const RuntimePlan& plan, const CalibrateOptions& o) : plan_(plan), o_(o), rng_(12345) {
    const ModelDims& d = plan.dims;
    B_ = plan.plan.micro_batch_size;
    T_ = d.seq_length;
    positions_ = context_parallel_positions(T_, plan.plan.cp, 0);  // every rank's the same work
    C_ = d.hidden_size;
    V_ = d.vocab_size;
  }

  // A call that runs the runtime's implementation of `w` once on buffers of fresh random
  // values (owned by this timer, so the call stays valid as long as it).
  std::function<void()> launcher(const KernelWork& w) {
    const std::string& k = w.kernel;
    const KernelShape& s = w.shape;
    if (k == "linear.forward") {
      auto x = floats(s.m * s.k), wt = floats(s.n * s.k), b = floats(s.n), y = floats(s.m * s.n);
      return launch([=, this] { layers::linear_forward(y.data(), x.data(), wt.data(), b.data(), s.m, s.k, s.n); });
    }
    if (k == "linear.backward_input") {  // dx (N, in) = dy (N, out) W (out, in): m = N, n = in, k = out
      auto dy = floats(s.m * s.k), wt = floats(s.k * s.n), dx = floats(s.m * s.n);
      return launch([=, this] { layers::linear_backward_input(dx.data(), dy.data(), wt.data(), s.m, s.n, s.k); });
    }
    if (k == "linear.backward_weight") {  // dW (out, in) += dy^T x: m = out, n = in, k = N
      auto dy = floats(s.k * s.m), x = floats(s.k * s.n), dw = floats(s.m * s.n), db = floats(s.m);
      return launch([=, this] { layers::linear_backward_weight(dw.data(), db.data(), dy.data(), x.data(), s.k, s.n, s.m, true); });
    }
    if (k == "attention.forward" || k == "attention.backward") {
      // The inventory counts attention's products per head and sample: 2 forward (QK^T, AV),
      // 4 backward; the launch itself covers all heads of the micro-batch.
      const int heads = static_cast<int>(s.batch / (k == "attention.forward" ? 2 : 4) / B_);
      const int C = heads * static_cast<int>(s.k);
      return attention_launcher(k, static_cast<int>(s.m), static_cast<int>(s.n), C, heads);
    }
    const std::size_t n = static_cast<std::size_t>(s.elements);
    const int rows = static_cast<int>(n / C_);
    if (k == "layernorm.forward" || k == "layernorm.backward_input" || k == "layernorm.backward_weight") {
      auto x = floats(n), out = floats(n), g = floats(C_), b = floats(C_), mean = floats(rows), rstd = floats(rows);
      layers::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), rows, C_);
      if (k == "layernorm.forward")
        return launch([=, this] {
          layers::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), g.data(), b.data(), rows, C_);
        });
      auto dout = floats(n), dres = floats(n);
      if (k == "layernorm.backward_input")
        return launch([=, this] {
          layers::layernorm_backward_input(out.data(), dout.data(), x.data(), mean.data(), rstd.data(), g.data(),
                                           dres.data(), rows, C_);
        });
      return launch([=, this] {
        layers::layernorm_backward_weight(g.data(), b.data(), dout.data(), x.data(), mean.data(), rstd.data(), rows, C_);
      });
    }
    if (k == "gelu.forward") {
      auto x = floats(n), y = floats(n);
      return launch([=, this] { layers::gelu_forward(y.data(), x.data(), n); });
    }
    if (k == "gelu.backward") {
      auto x = floats(n), dy = floats(n), dx = floats(n);
      return launch([=, this] { layers::gelu_backward(dx.data(), x.data(), dy.data(), n); });
    }
    if (k == "residual") {
      auto a = floats(n), b = floats(n), y = floats(n);
      return launch([=, this] {
        for (std::size_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
      });
    }
    if (k == "copy") {
      auto a = floats(n), y = floats(n);
      return launch([=, this] { std::copy(a.begin(), a.end(), y.begin()); });
    }
    if (k == "round") {
      auto a = floats(n);
      return launch([=, this] { round_and_scan(w.dtype, a.data(), n); });
    }
    if (k == "embedding.forward" || k == "embedding.backward") {
      // A rank's rows: b sequences of Tq (its share under context parallelism, at its positions).
      const int Tq = static_cast<int>(positions_.size());
      const int b = std::max(1, rows / Tq);
      auto tokens = ints(static_cast<std::size_t>(b) * Tq);
      std::uniform_int_distribution<int> pick(0, V_ - 1);
      for (auto& t : tokens) t = pick(rng_);
      auto wte = floats(static_cast<std::size_t>(V_) * C_), wpe = floats(static_cast<std::size_t>(T_) * C_);
      auto out = floats(static_cast<long>(b) * Tq * C_);
      const int* pos = positions_.data();
      if (k == "embedding.forward")
        return launch([=, this] {
          layers::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), b, Tq, C_, pos);
        });
      return launch([=, this] {
        layers::embedding_backward(wte.data(), wpe.data(), out.data(), tokens.data(), b, Tq, C_, pos);
      });
    }
    if (k == "cross_entropy.forward" || k == "cross_entropy.backward") {
      const int rows_v = static_cast<int>(n / V_);
      auto targets = ints(rows_v);
      std::uniform_int_distribution<int> pick(0, V_ - 1);
      for (auto& t : targets) t = pick(rng_);
      auto logits = floats(n), lse = floats(rows_v), dlogits = floats(n);
      layers::cross_entropy_forward(lse.data(), logits.data(), targets.data(), rows_v, V_);
      if (k == "cross_entropy.forward")
        return launch([=, this] { layers::cross_entropy_forward(lse.data(), logits.data(), targets.data(), rows_v, V_); });
      return launch([=, this] {
        layers::cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), rows_v, V_, 1.0f);
      });
    }
    if (k == "commit") {  // a weight gradient into the accumulation buffer (stage_model.cpp commit)
      const auto& pr = plan_.plan.config.precision;
      auto produced = floats(n), acc = floats(n);
      if (w.bytes <= 4.0 * static_cast<double>(n)) return launch([=, this] { scan(acc.data(), n); });
      return launch([=, this] {
        round_and_scan(pr.compute, produced.data(), n);
        for (std::size_t i = 0; i < n; ++i) acc[i] += produced[i];
        round_and_scan(pr.grad_accumulation, acc.data(), n);
      });
    }
    if (k == "unscale") {
      // The optimizer step's unscaling (cpu_engine.cpp optimizer_step), from memory: the step meets
      // the gradients the backward wrote long before.
      auto next = copies_past_cache<std::span<float>>(static_cast<std::size_t>(n) * sizeof(float), [&] { return floats(n); });
      return launch([next, this] {
        const float s = unit_scale_;  // a load, so that the product is made as the runtime makes it
        for (float& x : next()) x *= s;
      });
    }
    if (k == "grad_norm") {
      auto g = floats(n);
      return launch([=, this] {
        double sumsq = 0;
        for (float v : g) sumsq += static_cast<double>(v) * v;
        sink_ += sumsq;
      });
    }
    if (k == "adam" || k == "sgd") {
      const auto& tr = plan_.plan.config.training;
      OptimizerSettings set;
      set.kind = tr.optimizer;
      set.learning_rate = tr.lr;
      set.beta1 = tr.adam_beta1, set.beta2 = tr.adam_beta2, set.eps = tr.adam_eps, set.weight_decay = tr.weight_decay;
      // From memory: the step meets a stage's master weights, moments and gradients once a step.
      struct Copy {
        OptimizerState* state;
        std::span<float> weights, grads;
      };
      const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(float) * (tr.optimizer == Optimizer::sgd ? 3 : 4);
      auto next = copies_past_cache<Copy>(bytes, [&] {
        return Copy{optimizers_.emplace_back(std::make_unique<OptimizerState>(set, n)).get(), floats(n, 0.02f),
                    floats(n, 1e-3f)};
      });
      const DType master = plan_.plan.config.precision.master_weights;
      return launch([next, master] {
        const Copy& c = next();
        c.state->step(c.weights, c.grads, 1.0f);
        if (master != DType::fp32) round_inplace(master, c.weights);
      });
    }
    if (k == "zero") {
      auto g = floats(n);
      return launch([=, this] { std::fill(g.begin(), g.end(), 0.0f); });
    }
    if (k == kShardCopyKernel) {
      // From memory, as the runtime copies the flat gradients a backward wrote long before (and
      // as the all-reduce benchmark times its rings).
      using Pair = std::pair<std::span<float>, std::span<float>>;
      auto next = copies_past_cache<Pair>(2 * static_cast<std::size_t>(n) * sizeof(float),
                                          [&] { return Pair{floats(n), floats(n)}; });
      return launch([next] {
        const auto& [from, to] = next();
        std::copy(from.begin(), from.end(), to.begin());
      });
    }
    if (k == kUnitCopyKernel) {
      // As the runtime copies around one ZeRO-3 unit's gather (cpu_engine.cpp gather_group): its
      // own section from the flat shard into the gather's buffer, then every section out of that
      // buffer into the unit's weights. The buffer is the communication thread's one scratch
      // (in cache); shard and weights come from memory, each launch on the next copy of them.
      const std::size_t d = static_cast<std::size_t>(std::max(1, plan_.plan.data_shards()));
      const auto unit = static_cast<std::size_t>(std::llround(static_cast<double>(n) * d / (d + 1)));
      const std::size_t section = unit / d;
      using Pair = std::pair<std::span<float>, std::span<float>>;
      auto next = copies_past_cache<Pair>((section + unit) * sizeof(float), [&] {
        return Pair{floats(static_cast<long>(section)), floats(static_cast<long>(unit))};
      });
      auto buffer = floats(static_cast<long>(unit));
      return launch([next, buffer] {
        const auto& [shard, weights] = next();
        std::copy(shard.begin(), shard.end(), buffer.begin());
        std::copy(buffer.begin(), buffer.end(), weights.begin());
      });
    }
    throw std::logic_error("calibrate: no CPU implementation to time for kernel " + k);
  }

 private:
  std::span<float> floats(long n, float scale = 1.0f) {
    return floats_.emplace_back(random_floats(static_cast<std::size_t>(n), rng_, scale));
  }
  // The attention core as a rank runs it (inventory shape m = Tq queries, n = T keys; the stage
  // model's attention_core): its rows of q, k and v, and the keys and values it attends over,
  // its own (Tq = T) or, under context parallelism, every rank's gathered, its queries at their
  // positions.
  std::function<void()> attention_launcher(const std::string& k, int Tq, int T, int C, int heads) {
    const bool gathered = Tq != T;
    const std::ptrdiff_t qw = 3 * C, w = gathered ? 2 * C : qw;
    auto qkv = floats(static_cast<long>(B_) * Tq * qw), out = floats(static_cast<long>(B_) * Tq * C);
    auto probs = floats(static_cast<long>(B_) * heads * Tq * T), scratch = floats(static_cast<long>(Tq) * T);
    const auto kv = gathered ? floats(static_cast<long>(B_) * T * w) : qkv.subspan(C);
    const layers::AttentionShape shape{B_, Tq, T, gathered ? positions_.data() : nullptr};
    auto forward = [=] {
      layers::attention_forward<float>(out.data(), probs.data(), scratch.data(), {qkv.data(), qw}, {kv.data(), w},
                                       {kv.data() + C, w}, shape, C, heads, layers::no_post);
    };
    forward();
    if (k == "attention.forward") return launch(forward);
    auto dqkv = floats(static_cast<long>(qkv.size()));
    const auto dkv = gathered ? floats(static_cast<long>(kv.size())) : dqkv.subspan(C);
    auto dout = floats(static_cast<long>(out.size()));
    return launch([=] {
      layers::attention_backward<float>({dqkv.data(), qw}, {dkv.data(), w}, {dkv.data() + C, w}, scratch.data(),
                                        dout.data(), {qkv.data(), qw}, {kv.data(), w}, {kv.data() + C, w},
                                        probs.data(), shape, C, heads, layers::no_post);
    });
  }
  std::span<std::int32_t> ints(std::size_t n) { return ints_.emplace_back(n); }
  template <class F>
  std::function<void()> launch(F&& f) {
    return std::function<void()>(std::forward<F>(f));
  }
  std::deque<std::vector<float>> floats_;  // stable addresses: launchers keep references
  std::deque<std::vector<std::int32_t>> ints_;
  std::vector<std::unique_ptr<OptimizerState>> optimizers_;

  const RuntimePlan& plan_;
  const CalibrateOptions& o_;
  std::mt19937 rng_;
  int B_, T_, C_, V_;
  std::vector<int> positions_;  // a context-parallel rank's rows' positions (rank 0's)
  double sink_ = 0;
  float unit_scale_ = 1.0f;  // the unscale kernel's factor, read at each launch (not folded away)
};

double machine_memory_gib() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? static_cast<double>(pages) * size / (1024.0 * 1024 * 1024) : 0;
}

void pin_to(int core) { pin_to_core(pthread_self(), core); }

// A stage of the runtime's own blocks with its input and gradient buffers.
struct StageBench {
  std::unique_ptr<StageModel> model;
  std::vector<float> in, out, grad_out, grad_in;

  // `split`: the backward runs as the zero-bubble schedules run it, input pass then weight pass.
  bool split = false;

  StageBench(const StageSpec& spec, std::uint32_t seed, bool split_backward)
      : model(std::make_unique<StageModel>(spec)), split(split_backward) {
    // A tensor-parallel shard or context-parallel rank timed alone: its work, without its groups'
    // collectives (a context-parallel rank's gathers leave its room for every rank's keys as it was).
    model->set_tensor_parallel_group(&TimingOnlyGroup::instance());
    model->set_context_parallel_group(&TimingOnlyGroup::instance());
    model->init(seed);
    std::mt19937 rng(seed);
    const std::size_t act = model->activation_elements();
    in = random_floats(act, rng);
    grad_out = random_floats(act, rng, 1e-3f);
    out.resize(act);
    grad_in.resize(act);
  }
  // Seconds of one forward and one backward of micro-batch 0 (a split one's two passes apart).
  StageSeconds time() {
    StageSeconds t{forward(), 0, 0};
    std::tie(t.backward, t.backward_weight) = backward();
    return t;
  }
  // The two halves of time(), for callers that run other stages between them.
  double forward() {
    const auto a = Clock::now();
    model->forward(0, nullptr, nullptr, in.data(), out.data());
    return seconds_since(a);
  }
  // The backward (a split one's input and weight passes), then the gradients zeroed (untimed).
  std::pair<double, double> backward() {
    StageModel& st = *model;
    const auto a = Clock::now();
    std::pair<double, double> t{0, 0};
    if (split) {
      st.backward_input(0, grad_out.data(), 1.0f, grad_in.data());
      t.first = seconds_since(a);
      const auto b = Clock::now();
      st.backward_weight(0);
      t.second = seconds_since(b);
    } else {
      st.backward_begin(0, grad_out.data(), 1.0f);
      for (int u = 0; u < st.backward_units(); ++u) st.backward_unit(0);
      st.backward_end(0, grad_in.data());
      t.first = seconds_since(a);
    }
    st.zero_gradients();
    return t;
  }

 private:
  static double seconds_since(Clock::time_point from) {
    return std::chrono::duration<double>(Clock::now() - from).count();
  }
};

}  // namespace

int rotation_rounds(int cores, int ranks) { return (ranks + cores - 1) / cores; }

int rotation_rank(int round, int core, int cycle, int cores, int ranks, int cell) {
  const int slot = round * cores + core;
  if (slot >= ranks) return -1;
  return (slot + cycle * cell) % ranks;
}

std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return fmt::format("{}, {} cores", model, host_cores());
}

namespace {

// The CPU's side of calibration: the runtime's own kernels on a thread pinned to core 0, and a
// stage of its blocks on every rank's core.
class CpuClock final : public KernelClock {
 public:
  CpuClock(const RuntimePlan& plan, const CalibrateOptions& options, const std::vector<KernelWork>& kernels)
      : pin_(options.pin), timer_(plan, options) {
    const int cores = host_cores();
    shared_ = pin_ && plan.plan.num_ranks() * plan.plan.gpus_per_rank() > cores;
    for (const KernelWork& w : kernels) calls_.push_back(timer_.launcher(w));
    // A middle stage of a rank's blocks at the plan's shapes, one per core that runs a rank
    // (ranks that share cores run one compute op per core at a time: as many as the cores; a
    // tensor- or context-parallel plan's ranks are its shards).
    StageSpec spec = middle_stage_spec(plan, KernelCalibrator::compose_layers(plan.plan));
    const int tp = plan.plan.tp, world = plan.plan.num_ranks() * plan.plan.gpus_per_rank();
    const World grid = World::of(plan.plan);
    tp_ = tp;
    const int ranks = pin_ ? std::min(world, cores) : 1;
    const bool split = plan.plan.config.parallelism.schedule == ScheduleKind::zb_h1;
    for (int c = 0; c < ranks; ++c) {
      spec.tensor_parallel_rank = grid.coord(c).tp;
      spec.context_parallel_rank = grid.coord(c).cp;
      stages_.emplace_back(spec, 7, split);
    }
    // Ranks that share cores: a stage of every other rank thread too, for the rotation they take
    // the cores in (time_rotation).
    if (shared_)
      for (int c = ranks; c < world; ++c) {
        spec.tensor_parallel_rank = grid.coord(c).tp;
        spec.context_parallel_rank = grid.coord(c).cp;
        others_.emplace_back(spec, 7, split);
      }
    // Under tensor parallelism with a core per shard, the stages timed together are the world's
    // shards and run their groups' collectives for real (an in-process world of their own): what
    // waiting for one another costs on this machine, now, goes into the core factors (a shard is on
    // every layer's critical path of its group), as the run will pay it.
    // So too where tensor-parallel cells share the cores and a cell's turn takes as many cores as it
    // has shards (time_rotation runs a cell's shards side by side in a round); groups_ is then by
    // rank.
    if (tp > 1 && plan.plan.cp == 1 && pin_ && (world <= cores || (shared_ && cores % tp == 0))) {
      tp_world_ = std::make_unique<InProcessWorld>(world);
      for (int c = 0; c < world; ++c) {
        comms_.push_back(tp_world_->communicator(c, kCpuCommPoll));  // as the engine's pinned ranks wait
        groups_.push_back(std::make_unique<CommunicatorGroup>(*comms_.back(), grid.tensor_parallel_group(c)));
      }
    }
    on_timing_thread([&] {
      for (const auto& c : calls_) c();  // warm-up: first touches, lazy allocations
      stages_[0].time();
    });
    // Each core's rank's optimizer update (runtime_optimizer_kernels of its shard: its stage's
    // parameters, split by ZeRO), from memory as a step meets them. Where ranks share cores they
    // update in turns: not timed side by side.
    if (pin_ && !shared_ && ranks > 1) {
      for (int c = 0; c < ranks; ++c) {
        update_timers_.push_back(std::make_unique<KernelTimer>(plan, options));
        std::vector<std::function<void()>>& launches = updates_.emplace_back();
        for (const KernelWork& w : rank_update_kernels(plan.plan, grid.coord(c).pp, true))
          for (int k = 0; k < w.count; ++k) launches.push_back(update_timers_.back()->launcher(w));
      }
    }
  }

  std::string placement() const override { return pin_ ? "core 0, pinned" : "one thread"; }

  void on_timing_thread(const std::function<void()>& body) override {
    on_own_thread([&] {
      if (pin_) pin_to(0);
      body();
    });
  }

  double time_kernel(std::size_t i) override {
    calls_[i]();  // untimed: its operands in cache, as a kernel finds what the one before it wrote
    const auto a = Clock::now();
    calls_[i]();
    return std::chrono::duration<double>(Clock::now() - a).count();
  }

  StageSeconds time_stage() override { return stages_[0].time(); }
  int stage_ranks() const override { return static_cast<int>(stages_.size()); }

  std::vector<double> time_stages_together() override {
    if (shared_) return time_rotation();
    const int n = static_cast<int>(stages_.size());
    std::vector<double> seconds(static_cast<std::size_t>(n));
    std::barrier start(n);
    std::vector<std::thread> threads;
    const std::uint64_t first_tag = next_tag_;
    next_tag_ += 1ull << 32;  // each pass's collectives under tags of their own
    for (int c = 0; c < n; ++c)
      threads.emplace_back([&, c] {
        pin_to(c);
        StageBench& stage = stages_[static_cast<std::size_t>(c)];
        if (!groups_.empty()) {  // stage c is shard c
          groups_[static_cast<std::size_t>(c)]->restart(first_tag);
          stage.model->set_tensor_parallel_group(groups_[static_cast<std::size_t>(c)].get());
        }
        // A rank with a core of its own runs its stage warm: each stage once untimed first (core 0's
        // was just timed alone, and its caches hold it; the others' read 10% slower).
        stage.time();
        start.arrive_and_wait();
        seconds[static_cast<std::size_t>(c)] = stage.time().total();
        stage.model->set_tensor_parallel_group(&TimingOnlyGroup::instance());  // stage 0 is also timed alone
      });
    for (auto& t : threads) t.join();
    return seconds;
  }
  // Ranks that share cores take them in turns, one op at a time: between two of a rank's ops the
  // other ranks' ops ran on its core and moved its weights and activations out of the caches near
  // it, while the other cores ran theirs. Every rank's stage runs in such a rotation
  // (rotation_rank), a round at a time on every core at once: all the ranks' forwards, then all
  // their backwards, once untimed (the pass's kernels evicted everything; a cycle leaves each rank
  // as the run's rotation keeps it) and once timed. A core's seconds: the mean of its timed forward
  // and backward per rank. The calibration used to time each core running the stage the other
  // core ran last, one stage per core: up to 6% faster than eight rotating on two cores
  // (docs/validation.md, "Thirtieth session").
  std::vector<double> time_rotation() {
    const int n = static_cast<int>(stages_.size());
    const int ranks = n + static_cast<int>(others_.size());
    const int rounds = rotation_rounds(n, ranks);
    auto stage = [&](int r) -> StageBench& {
      return r < n ? stages_[static_cast<std::size_t>(r)] : others_[static_cast<std::size_t>(r - n)];
    };
    // Tensor-parallel cells: a cell's shards in one round, meeting at their group's collectives.
    const int cell = groups_.empty() ? 1 : tp_;
    const std::uint64_t first_tag = next_tag_;
    next_tag_ += 1ull << 32;
    for (auto& g : groups_) g->restart(first_tag);
    std::vector<double> seconds(static_cast<std::size_t>(n), 0.0);
    std::barrier start(n);
    std::vector<std::thread> threads;
    for (int c = 0; c < n; ++c)
      threads.emplace_back([&, c] {
        pin_to(c);
        double sum = 0;
        int timed = 0;
        for (int cycle = 0; cycle < 2; ++cycle)
          for (const bool forward : {true, false})
            for (int k = 0; k < rounds; ++k) {
              start.arrive_and_wait();
              const int r = rotation_rank(k, c, cycle, n, ranks, cell);
              if (r < 0) continue;  // a spare core in the last round
              StageBench& st = stage(r);
              if (!groups_.empty()) st.model->set_tensor_parallel_group(groups_[static_cast<std::size_t>(r)].get());
              double t = 0;
              if (forward) {
                t = st.forward();
              } else {
                const auto [input, weight] = st.backward();
                t = input + weight;
              }
              if (cycle == 1) {
                sum += t;
                timed += forward ? 1 : 0;
              }
            }
        seconds[static_cast<std::size_t>(c)] = timed > 0 ? sum / timed : 0;
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r) stage(r).model->set_tensor_parallel_group(&TimingOnlyGroup::instance());
    return seconds;
  }

  // Each core's stage alone, the others idle, right after the stages together (which left it warm
  // on its core): whether a core is slow by itself (a busy neighbour on a shared host) or only
  // beside the others (shared caches and memory bandwidth). Not where ranks share cores (they take
  // them in turns) or shards run their groups' collectives (one alone would wait for its partners).
  std::vector<double> time_stages_alone() override {
    const int n = static_cast<int>(stages_.size());
    if (shared_ || !groups_.empty() || n <= 1) return {};
    std::vector<double> seconds(static_cast<std::size_t>(n), 0.0);
    for (int c = 1; c < n; ++c) {
      std::thread t([&, c] {
        pin_to(c);
        seconds[static_cast<std::size_t>(c)] = stages_[static_cast<std::size_t>(c)].time().total();
      });
      t.join();
    }
    return seconds;
  }
  bool stages_run_tensor_parallel() const override { return !groups_.empty(); }

  // Every core's update at once, each on its own pinned core, then core 0's alone.
  UpdateSeconds time_updates_together() override {
    const int n = static_cast<int>(updates_.size());
    if (n <= 1) return {};
    UpdateSeconds out;
    out.together.assign(static_cast<std::size_t>(n), 0.0);
    std::barrier start(n);
    std::vector<std::thread> threads;
    for (int c = 0; c < n; ++c)
      threads.emplace_back([&, c] {
        pin_to(c);
        start.arrive_and_wait();
        out.together[static_cast<std::size_t>(c)] = update_seconds(c);
      });
    for (auto& t : threads) t.join();
    on_timing_thread([&] { out.alone = update_seconds(0); });
    return out;
  }

 private:
  double update_seconds(int core) {
    const auto a = Clock::now();
    for (const auto& launch : updates_[static_cast<std::size_t>(core)]) launch();
    return std::chrono::duration<double>(Clock::now() - a).count();
  }

  bool pin_;
  bool shared_ = false;  // more ranks than cores
  KernelTimer timer_;
  std::vector<std::function<void()>> calls_;
  std::vector<StageBench> stages_;  // [core]; stages_[0] also runs alone
  std::vector<StageBench> others_;  // ranks that share cores: the stages of rank threads beyond the cores
  std::vector<std::unique_ptr<KernelTimer>> update_timers_;  // [core]: the buffers of its update
  std::vector<std::vector<std::function<void()>>> updates_;    // [core]: its update's launches
  // Tensor parallelism: the shards' groups when they are timed together.
  std::unique_ptr<InProcessWorld> tp_world_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<CommunicatorGroup>> groups_;
  std::uint64_t next_tag_ = 1;
  int tp_ = 1;
};

}  // namespace

std::unique_ptr<KernelCalibrator> make_cpu_kernel_calibrator(const RuntimePlan& plan, const CalibrateOptions& options) {
  return std::make_unique<KernelCalibrator>(
      plan, options, distinct_kernels(plan.plan, 4), 4,
      [](const RuntimePlan& p, const CalibrateOptions& o, const std::vector<KernelWork>& kernels) {
        return std::make_unique<CpuClock>(p, o, kernels);
      });
}

double core_handoff_seconds(int cells, int shards, int turns_per_cell) {
  // The engine's own gate, as a step with more ranks than cores uses it: every cell's shards on
  // threads of their own, turns in a fixed round-robin order (each thread asleep between its
  // turns), each turn a fixed spin of `work` on every shard. A core's cycle is a turn's work and
  // the handoff to the next turn; turns run side by side where the cores allow.
  const int cores = host_cores();
  const int at_once = std::max(1, cores / std::min(shards, cores));
  const auto work = std::chrono::microseconds{50};
  std::vector<CoreTurn> turns;
  for (int k = 0; k < turns_per_cell; ++k)
    for (int c = 0; c < cells; ++c) turns.push_back(CoreTurn{c, k, 0});
  CoreGate gate(cores, cells, shards, turns, std::chrono::seconds(10),
                cpu_turns_wait_first(shards, may_run_first_on_core()));  // as the engine's
  gate.reset();
  std::barrier start(cells * shards + 1);
  std::vector<std::thread> threads;
  for (int c = 0; c < cells; ++c)
    for (int sh = 0; sh < shards; ++sh)
      threads.emplace_back([&, c, sh] {
        gate.enrol(c, sh);
        start.arrive_and_wait();
        gate.wait_first();
        for (int k = 0; k < turns_per_cell; ++k) {
          CoreGate::Hold core(&gate, CoreTurn{c, k, 0}, sh);
          const auto until = Clock::now() + work;
          while (Clock::now() < until) {
          }
        }
      });
  start.arrive_and_wait();
  const auto t0 = Clock::now();
  for (auto& t : threads) t.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cycles = std::ceil(static_cast<double>(turns.size()) / at_once);
  return std::max(0.0, elapsed / cycles - std::chrono::duration<double>(work).count());
}

namespace {

// Median over `calls` 2-member all-reduces of `elems` floats, each member pinned to its core, of the
// time from the last member's arrival to the call's end, member 1 arriving `late` after member 0:
// asleep until then, or computing (spinning on its core) when `late_computes`. `run_first`: the
// members run first on their cores (run_first_on_core), as the engine's communication threads
// beside compute do.
double after_last_arrival_seconds(std::size_t elems, const CpuCollectivePolls& polls, std::chrono::microseconds late,
                                  bool late_computes, bool run_first, int calls) {
  InProcessWorld world(2);
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 2; ++r) comms.push_back(world.communicator(r, polls.first, nullptr, polls.in_call));
  std::vector<double> after(static_cast<std::size_t>(calls));
  std::atomic<std::int64_t> last_ns{0};
  std::barrier sync(2);
  std::exception_ptr failed;
  std::mutex failed_mu;
  {
    std::vector<std::jthread> members;
    for (int r = 0; r < 2; ++r)
      members.emplace_back([&, r] {
        try {
          pin_to_core(pthread_self(), r);
          if (run_first) run_first_on_core(pthread_self());
          std::vector<float> buf(elems, 1.0f);
          const int group[] = {0, 1};
          const auto now_ns = [] { return std::chrono::steady_clock::now().time_since_epoch().count(); };
          for (int i = 0; i < calls; ++i) {
            sync.arrive_and_wait();
            if (r == 1) {
              if (late.count() > 0 && late_computes) {
                const auto until = Clock::now() + late;
                while (Clock::now() < until) {
                }
              } else if (late.count() > 0) {
                std::this_thread::sleep_for(late);
              }
              last_ns.store(now_ns());
            }
            comms[static_cast<std::size_t>(r)]->all_reduce(buf, group, static_cast<std::uint64_t>(i + 1), ReduceOp::sum,
                                                           DType::fp32, Divide::none);
            const std::int64_t end = now_ns();
            sync.arrive_and_wait();  // last_ns is this call's
            if (r == 0) after[static_cast<std::size_t>(i)] = static_cast<double>(end - last_ns.load()) * 1e-9;
          }
        } catch (...) {
          {
            std::lock_guard lock(failed_mu);
            if (!failed) failed = std::current_exception();
          }
          comms[static_cast<std::size_t>(r)]->abort(fmt::format("calibrate: member {} of a 2-member all-reduce failed", r));
          sync.arrive_and_drop();
        }
      });
  }
  if (failed) std::rethrow_exception(failed);
  return median(std::move(after));
}

std::size_t ring_elements(std::size_t bytes) {
  return std::max<std::size_t>(bytes / sizeof(float), 2 * 1024);  // a ring, not the direct path
}

}  // namespace

double comm_wake_seconds(std::size_t bytes, int calls) {
  if (host_cores() < 2) throw std::invalid_argument("comm_wake_seconds needs two cores");
  const CpuCollectivePolls polls = cpu_collective_polls(true, true);
  std::atomic<bool> stop{false};
  std::vector<std::jthread> compute;  // the ranks' compute threads, always busy; joined on every exit
  struct Stop {
    std::atomic<bool>& flag;
    ~Stop() { flag = true; }
  } stop_compute{stop};  // declared after them: set before they are joined
  for (int c = 0; c < 2; ++c)
    compute.emplace_back([&stop, c] {
      pin_to_core(pthread_self(), c);
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  const std::size_t elems = ring_elements(bytes);
  const double together = after_last_arrival_seconds(elems, polls, std::chrono::microseconds{0}, false, true, calls);
  const double slept = after_last_arrival_seconds(elems, polls, std::chrono::microseconds{1000}, false, true, calls);
  return std::max(0.0, slept - together);
}

CommLateCurve comm_late_curve(std::size_t bytes, std::span<const std::chrono::microseconds> leads, int calls) {
  if (host_cores() < 2) throw std::invalid_argument("comm_late_curve needs two cores");
  const CpuCollectivePolls polls = cpu_collective_polls(true, false);
  const std::size_t elems = ring_elements(bytes);
  // Four interleaved rounds of each kind of call, so that a host whose speed moves between them
  // moves every lead alike.
  const int per_round = std::max(1, calls / 4);
  std::vector<double> together;
  std::vector<std::vector<double>> late(leads.size());
  for (int round = 0; round < 4; ++round) {
    together.push_back(after_last_arrival_seconds(elems, polls, std::chrono::microseconds{0}, true, false, per_round));
    for (std::size_t i = 0; i < leads.size(); ++i)
      late[i].push_back(after_last_arrival_seconds(elems, polls, leads[i], true, false, per_round));
  }
  CommLateCurve curve;
  const double base = median(std::move(together));
  curve.together_us = base * 1e6;
  for (std::size_t i = 0; i < leads.size(); ++i)
    curve.points.push_back({static_cast<double>(leads[i].count()), std::max(0.0, median(std::move(late[i])) - base) * 1e6});
  return curve;
}

std::vector<std::chrono::microseconds> comm_late_leads() {
  const std::chrono::microseconds poll = cpu_collective_polls(true, false).first;
  return {std::chrono::microseconds{1000}, std::chrono::microseconds{2000}, std::chrono::microseconds{4000},
          poll * 9 / 10, poll * 11 / 10, poll * 2};
}

HardwareProfile describe_cpu_profile(const RuntimePlan& plan, const std::string& name) {
  HardwareProfile p;
  p.name = name;
  p.backend = "cpu";
  p.device = cpu_description();
  p.measured = now_iso();
  p.scenario = plan.plan.source;
  p.emulated_low_precision = true;
  const int cores = host_cores();
  p.ranks_per_node = cores;
  p.collectives_take_rank_core = true;  // the engine pins a rank's communication thread to its core
  p.memory_gib = machine_memory_gib() / cores;
  if (plan.plan.num_ranks() * plan.plan.gpus_per_rank() > cores)  // ranks take the cores in turns
    p.core_handoff_us = core_handoff_seconds(plan.plan.num_ranks(), plan.plan.gpus_per_rank()) * 1e6;
  else if (cores >= 2 && plan.plan.num_ranks() > 1 && cpu_collectives_beside_compute(plan.plan)) {
    // Pinned ranks whose communication thread polls only briefly for a peer (cpu_engine.h).
    p.comm_poll_us = static_cast<double>(cpu_collective_polls(true, true).first.count());
    const double bucket = plan.plan.config.communication.bucket_size_mib * 1024 * 1024;
    p.comm_wake_us = comm_wake_seconds(static_cast<std::size_t>(std::clamp(bucket, 64.0 * 1024, 4.0 * 1024 * 1024))) * 1e6;
  } else if (cores >= 2 && plan.plan.num_ranks() > 1) {
    // Pinned ranks whose communication threads poll through a step's waits: a collective found by
    // a member that polled for it (a pipeline's embedding sum waits out the other stage's last
    // backward) runs slower, by a latency, not a rate (+1.4 us at 16 KiB, +1.4-6.5 at 128 KiB,
    // +3.3-3.5 at 1 MiB after 2 ms on one host; docs/validation.md, "Thirty-first session"), which
    // grows with the lead on another (+1-14 us after 1 ms, +38-57 after 8-9 ms, +89-129 after
    // 10.5-12 ms, past the poll, asleep; "Forty-third session"): measured at 128 KiB at
    // comm_late_leads().
    constexpr std::size_t kBytes = std::size_t{128} << 10;
    const std::vector<std::chrono::microseconds> leads = comm_late_leads();
    CommLateCurve curve = comm_late_curve(kBytes, leads);
    p.comm_late = std::move(curve.points);
    p.comm_late_bytes = static_cast<double>(kBytes);
    p.comm_late_base_us = curve.together_us;
  }
  return p;
}

HardwareProfile calibrate_cpu(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options,
                              CommBenchResult* comm_table) {
  return calibrate_profile(cpu_backend(), plan, name, options, comm_table);
}

}  // namespace trainsim::runtime
