#include "runtime/calibrate/calibrate.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <ctime>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <fstream>
#include <random>
#include <span>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/kernel_inventory.h"
#include "core/median.h"
#include "runtime/model/layers.h"
#include "runtime/model/stage_model.h"
#include "runtime/numerics/lowp.h"
#include "runtime/numerics/optimizer.h"

namespace trainsim::runtime {

namespace {

using Clock = std::chrono::steady_clock;

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(std::max<std::size_t>(n, 1));
  for (float& x : v) x = d(rng);
  return v;
}


// Times one kernel of the inventory with the runtime's implementation of it.
class KernelTimer {
 public:
  KernelTimer(const RuntimePlan& plan, const CalibrateOptions& o) : plan_(plan), o_(o), rng_(12345) {
    const ModelDims& d = plan.dims;
    B_ = plan.plan.micro_batch_size;
    T_ = d.seq_length;
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
      auto qkv = floats(static_cast<std::size_t>(B_) * T_ * 3 * C), out = floats(static_cast<std::size_t>(B_) * T_ * C);
      auto probs = floats(static_cast<std::size_t>(B_) * heads * T_ * T_), scratch = floats(static_cast<std::size_t>(T_) * T_);
      layers::attention_forward(out.data(), probs.data(), scratch.data(), qkv.data(), B_, T_, C, heads, layers::no_post);
      if (k == "attention.forward")
        return launch([=, this] {
          layers::attention_forward(out.data(), probs.data(), scratch.data(), qkv.data(), B_, T_, C, heads,
                                    layers::no_post);
        });
      auto dqkv = floats(qkv.size()), dout = floats(out.size());
      return launch([=, this] {
        layers::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), probs.data(), B_, T_, C, heads,
                                   layers::no_post);
      });
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
      const int b = std::max(1, rows / T_);
      auto tokens = ints(static_cast<std::size_t>(b) * T_);
      std::uniform_int_distribution<int> pick(0, V_ - 1);
      for (auto& t : tokens) t = pick(rng_);
      auto wte = floats(static_cast<std::size_t>(V_) * C_), wpe = floats(static_cast<std::size_t>(T_) * C_), out = floats(n);
      if (k == "embedding.forward")
        return launch([=, this] { layers::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), b, T_, C_); });
      return launch([=, this] { layers::embedding_backward(wte.data(), wpe.data(), out.data(), tokens.data(), b, T_, C_); });
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
      OptimizerState* opt = optimizers_.emplace_back(std::make_unique<OptimizerState>(set, n)).get();
      auto weights = floats(n, 0.02f), grads = floats(n, 1e-3f);
      const DType master = plan_.plan.config.precision.master_weights;
      return launch([=, this] {
        opt->step(weights, grads, 1.0f);
        if (master != DType::fp32) round_inplace(master, weights);
      });
    }
    if (k == "zero") {
      auto g = floats(n);
      return launch([=, this] { std::fill(g.begin(), g.end(), 0.0f); });
    }
    throw std::logic_error("calibrate: no CPU implementation to time for kernel " + k);
  }

 private:
  std::span<float> floats(long n, float scale = 1.0f) {
    return floats_.emplace_back(random_floats(static_cast<std::size_t>(n), rng_, scale));
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
  double sink_ = 0;
};

// Runs `body` on a thread pinned to core 0 (when asked), rethrowing what it throws.
template <class F>
void on_core0(bool pin, F&& body) {
  on_own_thread([&] {
    if (pin) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(0, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    body();
  });
}

double machine_memory_gib() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? static_cast<double>(pages) * size / (1024.0 * 1024 * 1024) : 0;
}

}  // namespace

std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  return fmt::format("{}, {} cores", model, cores);
}

// A stage of the runtime's own blocks with its input and gradient buffers.
struct StageBench {
  std::unique_ptr<StageModel> model;
  std::vector<float> in, out, grad_out, grad_in;

  StageBench(const StageSpec& spec, std::uint32_t seed) : model(std::make_unique<StageModel>(spec)) {
    model->init(seed);
    std::mt19937 rng(seed);
    const std::size_t act = model->activation_elements();
    in = random_floats(act, rng);
    grad_out = random_floats(act, rng, 1e-3f);
    out.resize(act);
    grad_in.resize(act);
  }
  // Seconds of one forward and one backward of micro-batch 0.
  std::pair<double, double> time() {
    StageModel& st = *model;
    const auto a = Clock::now();
    st.forward(0, nullptr, nullptr, in.data(), out.data());
    const auto b = Clock::now();
    st.backward_begin(0, grad_out.data(), 1.0f);
    for (int u = 0; u < st.backward_units(); ++u) st.backward_unit(0);
    st.backward_end(0, grad_in.data());
    const auto c = Clock::now();
    st.zero_gradients();
    return {std::chrono::duration<double>(b - a).count(), std::chrono::duration<double>(c - b).count()};
  }
};

struct KernelCalibrator::State {
  std::vector<KernelWork> kernels;
  std::unique_ptr<KernelTimer> timer;
  std::vector<std::function<void()>> calls;
  std::vector<std::vector<double>> samples;  // [kernel][pass]
  std::vector<double> pass_seconds;          // all kernels, per pass
  // The composition check: a stage of the runtime's own blocks, forward and backward, timed in
  // every pass beside its kernels; and the same stage on every rank's core at once.
  std::vector<StageBench> stages;                 // [core]; stages[0] also runs alone
  std::vector<double> stage_forward, stage_backward;  // alone on core 0, per pass
  std::vector<std::vector<double>> core_seconds;  // [core][pass]: forward + backward, all cores busy
};

KernelCalibrator::KernelCalibrator(const RuntimePlan& plan, const CalibrateOptions& options)
    : plan_(plan), options_(options), s_(std::make_unique<State>()) {
  s_->kernels = distinct_kernels(plan.plan, 4);
  s_->timer = std::make_unique<KernelTimer>(plan, options_);
  for (const KernelWork& w : s_->kernels) s_->calls.push_back(s_->timer->launcher(w));
  s_->samples.resize(s_->kernels.size());

  // A middle stage (no embedding, no head) of kComposeLayers blocks at the plan's shapes, one
  // per core that runs a rank (none beyond the cores: oversubscribed ranks are not pinned).
  StageSpec spec;
  spec.dims = plan.dims;
  spec.first_layer = 0;
  spec.num_layers = kComposeLayers;
  spec.compute = plan.plan.config.precision.compute;
  spec.grad_accumulation = plan.plan.config.precision.grad_accumulation;
  spec.micro_batch_size = plan.plan.micro_batch_size;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int ranks = plan.plan.num_ranks() <= cores && options_.pin ? plan.plan.num_ranks() : 1;
  for (int c = 0; c < ranks; ++c) s_->stages.emplace_back(spec, 7);
  s_->core_seconds.resize(ranks);
  on_core0(options_.pin, [&] {
    for (const auto& c : s_->calls) c();  // warm-up: first touches, lazy allocations
    s_->stages[0].time();
  });
  if (ranks > 1) time_stages_on_every_core();
}

void KernelCalibrator::time_stages_on_every_core() {
  const int n = static_cast<int>(s_->stages.size());
  std::barrier start(n);
  std::vector<std::thread> threads;
  for (int c = 0; c < n; ++c)
    threads.emplace_back([&, c] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(c, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      start.arrive_and_wait();
      const auto [f, b] = s_->stages[c].time();
      s_->core_seconds[c].push_back(f + b);
    });
  for (auto& t : threads) t.join();
}

KernelCalibrator::~KernelCalibrator() = default;

std::size_t KernelCalibrator::num_kernels() const { return s_->kernels.size(); }
int KernelCalibrator::passes_done() const { return static_cast<int>(s_->pass_seconds.size()); }

void KernelCalibrator::run_passes(int passes) {
  on_core0(options_.pin, [&] {
    for (int p = 0; p < passes; ++p) {
      double total = 0;
      for (std::size_t i = 0; i < s_->calls.size(); ++i) {
        s_->calls[i]();  // untimed: its operands in cache, as a kernel finds what the one before it wrote
        const auto a = Clock::now();
        s_->calls[i]();
        const double t = std::chrono::duration<double>(Clock::now() - a).count();
        s_->samples[i].push_back(t);
        total += t;
      }
      s_->pass_seconds.push_back(total);
      const auto [f, b] = s_->stages[0].time();
      s_->stage_forward.push_back(f);
      s_->stage_backward.push_back(b);
    }
  });
  if (s_->stages.size() > 1)
    for (int p = 0; p < passes; ++p) time_stages_on_every_core();
}

std::vector<double> KernelCalibrator::core_factors() const {
  if (s_->stages.size() <= 1) return {};
  return stage_factors(s_->stage_forward, s_->stage_backward, s_->core_seconds);
}

std::vector<double> stage_factors(const std::vector<double>& forward_alone, const std::vector<double>& backward_alone,
                                  const std::vector<std::vector<double>>& together) {
  std::vector<double> alone;
  for (std::size_t i = 0; i < forward_alone.size(); ++i) alone.push_back(forward_alone[i] + backward_alone[i]);
  const double base = median(alone);
  std::vector<double> out;
  for (const auto& v : together) out.push_back(median(v) / base);
  return out;
}

Composition stage_composition(const ScenarioConfig& config, int layers, int storage,
                              const std::vector<KernelRate>& rates, double forward_seconds, double backward_seconds) {
  ScenarioConfig c = config;
  c.parallelism.pipeline_parallel_size = 3;
  c.parallelism.data_parallel_size = 1;
  c.parallelism.virtual_pipeline_stages = 1;
  c.parallelism.schedule = ScheduleKind::one_f_one_b;
  c.parallelism.layers_per_stage = {layers, layers, layers};
  c.model.num_layers = 3 * layers;
  c.cluster.num_gpus = c.cluster.gpus_per_node = 3;
  c.training.global_batch_size = 0;
  const ChunkKernels middle = chunk_kernels(Plan::from_config(c), storage)[1];
  auto priced = [&](const std::vector<KernelWork>& ws) {
    double t = 0;
    for (const KernelWork& w : ws)
      for (const KernelRate& k : rates)
        if (k.kernel == w.kernel && k.dtype == w.dtype && k.shape == w.shape) t += w.count * k.seconds;
    return t;
  };
  Composition out;
  const double f = priced(middle.forward), b = priced(middle.backward_input) + priced(middle.backward_weight);
  out.forward = f > 0 ? forward_seconds / f : 1;
  out.backward = b > 0 ? backward_seconds / b : 1;
  return out;
}

Composition KernelCalibrator::composition() const {
  // The same stage priced from its kernels, in the runtime's 4-byte floats.
  return stage_composition(plan_.plan.config, kComposeLayers, 4, rates(), median(s_->stage_forward),
                           median(s_->stage_backward));
}

void KernelCalibrator::run_until_settled() {
  while (!calibration_settled(options_, s_->pass_seconds)) run_passes(1);
}

bool calibration_settled(const CalibrateOptions& options, const std::vector<double>& pass_seconds) {
  const auto passes = static_cast<int>(pass_seconds.size());
  double total = 0;
  for (double t : pass_seconds) total += t;
  return passes >= options.max_passes || (passes >= options.min_passes && total >= options.min_seconds);
}

std::vector<KernelRate> KernelCalibrator::rates() const {
  std::vector<KernelRate> out;
  for (std::size_t i = 0; i < s_->kernels.size(); ++i) {
    std::vector<double> v = s_->samples[i];
    if (v.empty()) throw std::logic_error("KernelCalibrator::rates before any pass");
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    const KernelWork& w = s_->kernels[i];
    out.push_back(KernelRate{w.kernel, w.dtype, w.shape, w.bytes, v[v.size() / 2]});
  }
  return out;
}

double KernelCalibrator::speed_change(int first_passes) const {
  const auto& t = s_->pass_seconds;
  if (first_passes <= 0 || static_cast<std::size_t>(first_passes) >= t.size()) return 0;
  const double before = median({t.begin(), t.begin() + first_passes});
  const double after = median({t.begin() + first_passes, t.end()});
  return after / before - 1;
}

std::string now_iso() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", std::localtime(&t));
  return buf;
}

void on_own_thread(const std::function<void()>& body) {
  std::exception_ptr failed;
  std::thread worker([&] {
    try {
      body();
    } catch (...) {
      failed = std::current_exception();
    }
  });
  worker.join();
  if (failed) std::rethrow_exception(failed);
}

HardwareProfile describe_cpu_profile(const RuntimePlan& plan, const std::string& name) {
  HardwareProfile p;
  p.name = name;
  p.backend = "cpu";
  p.device = cpu_description();
  p.measured = now_iso();
  p.scenario = plan.plan.source;
  p.emulated_low_precision = true;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  p.ranks_per_node = cores;
  p.memory_gib = machine_memory_gib() / cores;
  return p;
}

void calibrate_communication(HardwareProfile& p, const CalibrateOptions& options, CommBenchResult* comm_table) {
  if (!options.communication) return;
  if (options.progress) options.progress("point-to-point and all-reduce benchmarks");
  const CommBenchResult comm = bench_in_process_comm(options.comm);
  apply_comm_bench(p, comm);
  if (comm_table) *comm_table = comm;
}

void apply_comm_bench(HardwareProfile& p, const CommBenchResult& comm, const std::string& where) {
  p.p2p = comm.p2p;
  p.allreduce = comm.allreduce;
  for (const CollectiveRow& r : comm.rows) {
    if (r.wrong != 0)
      throw std::runtime_error(fmt::format("calibrate: {} of {} bytes over {} ranks{} gave {} wrong elements", r.op,
                                           r.bytes, r.ranks, where, r.wrong));
    const std::pair<double, double> row{static_cast<double>(r.bytes), r.time_us * 1e-6};
    if (r.op == "sendrecv") p.p2p_table.rows.push_back(row);
    if (r.op == "all_reduce" && r.redop == "sum") p.allreduce_tables[r.ranks].rows.push_back(row);
  }
}

HardwareProfile calibrate_cpu(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options,
                              CommBenchResult* comm_table) {
  HardwareProfile p = describe_cpu_profile(plan, name);
  KernelCalibrator kernels(plan, options);
  if (options.progress) options.progress(fmt::format("timing {} kernels at the plan's shapes", kernels.num_kernels()));
  kernels.run_until_settled();
  p.kernels = kernels.rates();
  p.composition = kernels.composition();
  p.core_factors = kernels.core_factors();
  // The other formats the backend runs, so that a scenario naming this profile may compute
  // in any of them: the same shapes with the rounding of that format.
  for (DType d : options.precisions) {
    if (d == plan.plan.config.precision.compute) continue;
    RuntimePlan other = plan;
    ScenarioConfig c = plan.plan.config;
    c.precision.compute = d;
    other.plan = Plan::from_config(c);
    KernelCalibrator k(other, options);
    if (options.progress)
      options.progress(fmt::format("timing {} kernels in {}", k.num_kernels(), dtype_name(d)));
    k.run_until_settled();
    for (const KernelRate& r : k.rates()) p.kernels.push_back(r);
  }
  calibrate_communication(p, options, comm_table);
  return p;
}

}  // namespace trainsim::runtime
