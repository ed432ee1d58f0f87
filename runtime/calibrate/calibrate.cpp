#include "runtime/calibrate/calibrate.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <exception>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/kernel_inventory.h"
#include "core/median.h"

namespace trainsim::runtime {

KernelCalibrator::KernelCalibrator(const RuntimePlan& plan, const CalibrateOptions& options,
                                   std::vector<KernelWork> kernels, int storage_bytes, const ClockFactory& make_clock)
    : plan_(plan), options_(options), kernels_(std::move(kernels)), storage_bytes_(storage_bytes) {
  samples_.resize(kernels_.size());
  clock_ = make_clock(plan_, options_, kernels_);
  const int ranks = clock_->stage_ranks();
  if (ranks > 1) {
    rank_seconds_.resize(static_cast<std::size_t>(ranks));
    // Every rank's stage but rank 0's runs for the first time: a warm-up, not a sample.
    clock_->time_stages_together();
    clock_->time_updates_together();
  }
}

KernelCalibrator::~KernelCalibrator() = default;

std::string KernelCalibrator::placement() const { return clock_->placement(); }
std::size_t KernelCalibrator::num_kernels() const { return kernels_.size(); }
int KernelCalibrator::passes_done() const { return static_cast<int>(pass_seconds_.size()); }

void KernelCalibrator::run_passes(int passes) {
  clock_->on_timing_thread([&] {
    for (int p = 0; p < passes; ++p) {
      double total = 0;
      for (std::size_t i = 0; i < kernels_.size(); ++i) {
        const double t = clock_->time_kernel(i);
        samples_[i].push_back(t);
        total += t;
      }
      pass_seconds_.push_back(total);
      cold_.push_back(clock_->time_stage());
      warm_.push_back(clock_->time_stage());
    }
  });
  if (clock_->stage_ranks() > 1)
    for (int p = 0; p < passes; ++p) {
      const std::vector<double> seconds = clock_->time_stages_together();
      for (std::size_t r = 0; r < seconds.size(); ++r) rank_seconds_[r].push_back(seconds[r]);
      const std::vector<double> alone = clock_->time_stages_alone();
      if (alone.size() == seconds.size()) {
        alone_seconds_.resize(alone.size());
        for (std::size_t r = 0; r < alone.size(); ++r) alone_seconds_[r].push_back(alone[r]);
      }
      const UpdateSeconds updates = clock_->time_updates_together();
      if (updates.together.size() == seconds.size() && updates.alone > 0) {
        update_seconds_.resize(updates.together.size());
        for (std::size_t r = 0; r < updates.together.size(); ++r) update_seconds_[r].push_back(updates.together[r]);
        update_alone_seconds_.push_back(updates.alone);
      }
    }
}

void KernelCalibrator::run_until_settled() {
  while (!calibration_settled(options_, pass_seconds_)) run_passes(1);
}

std::vector<KernelRate> KernelCalibrator::rates() const { return rates(0, passes_done()); }

std::vector<KernelRate> KernelCalibrator::rates(int first_pass, int end_pass) const {
  if (passes_done() == 0) throw std::logic_error("KernelCalibrator::rates before any pass");
  const auto [first, end] = clamped(first_pass, end_pass);
  std::vector<KernelRate> out;
  for (std::size_t i = 0; i < kernels_.size(); ++i) {
    const KernelWork& w = kernels_[i];
    out.push_back(
        KernelRate{w.kernel, w.dtype, w.shape, w.bytes, median({samples_[i].begin() + first, samples_[i].begin() + end})});
  }
  return out;
}

Composition KernelCalibrator::composition() const { return composition(0, passes_done()); }

Composition KernelCalibrator::composition(int first_pass, int end_pass) const {
  // The same stage priced from its kernels, with the backend's storage bytes.
  const std::vector<KernelRate> measured = rates(first_pass, end_pass);
  const auto [first, end] = clamped(first_pass, end_pass);
  const auto compose = [&](const std::vector<StageSeconds>& t) {
    std::vector<double> f, b, w;
    for (int p = first; p < end; ++p) {
      const StageSeconds& s = t[static_cast<std::size_t>(p)];
      f.push_back(s.forward);
      b.push_back(s.backward);
      w.push_back(s.backward_weight);
    }
    return stage_composition(plan_.plan.config, compose_layers(plan_.plan), storage_bytes_, measured, median(f),
                             median(b), median(w));
  };
  Composition out = compose(warm_);
  out.first_forward = compose(cold_).forward;
  return out;
}

std::pair<int, int> KernelCalibrator::clamped(int first_pass, int end_pass) const {
  // At least one pass: the last one when the range holds none.
  const int n = passes_done();
  const int first = std::clamp(first_pass, 0, n - 1);
  return {first, std::clamp(end_pass, first + 1, n)};
}

int KernelCalibrator::compose_layers(const Plan& plan) {
  int most = 1;
  for (int s = 0; s < plan.pp; ++s) {
    int layers = 0;
    for (int j = 0; j < plan.vpp; ++j) layers += plan.layers_per_virtual_stage[static_cast<std::size_t>(j * plan.pp + s)];
    most = std::max(most, layers);
  }
  return most;
}

std::vector<double> KernelCalibrator::core_factors() const { return core_factors(0, passes_done()); }

std::vector<double> KernelCalibrator::core_factors(int first_pass, int end_pass) const {
  return factors_over(rank_seconds_, first_pass, end_pass);
}

std::vector<double> KernelCalibrator::core_alone_factors(int first_pass, int end_pass) const {
  if (alone_seconds_.empty() || alone_seconds_[0].size() != static_cast<std::size_t>(passes_done())) return {};
  std::vector<double> out = factors_over(alone_seconds_, first_pass, end_pass);
  if (!out.empty()) out[0] = 1.0;  // rank 0's alone is the base itself
  return out;
}

std::vector<double> KernelCalibrator::optimizer_core_factors(int first_pass, int end_pass) const {
  // Every pass timed the updates, or none is used (the passes must be the stages' passes).
  if (update_alone_seconds_.empty() || update_alone_seconds_.size() != static_cast<std::size_t>(passes_done())) return {};
  first_pass = std::clamp(first_pass, 0, passes_done());
  end_pass = std::clamp(end_pass, first_pass, passes_done());
  if (first_pass == end_pass) return {};
  const double alone = median({update_alone_seconds_.begin() + first_pass, update_alone_seconds_.begin() + end_pass});
  std::vector<double> out;
  for (const std::vector<double>& rank : update_seconds_)
    out.push_back(median({rank.begin() + first_pass, rank.begin() + end_pass}) / alone);
  return out;
}

std::vector<double> KernelCalibrator::factors_over(const std::vector<std::vector<double>>& per_rank, int first_pass,
                                                   int end_pass) const {
  if (clock_->stage_ranks() <= 1) return {};
  first_pass = std::clamp(first_pass, 0, passes_done());
  end_pass = std::clamp(end_pass, first_pass, passes_done());
  if (first_pass == end_pass) return {};
  std::vector<double> forward, backward;
  for (int p = first_pass; p < end_pass; ++p) {
    const StageSeconds& s = warm_[static_cast<std::size_t>(p)];
    forward.push_back(s.forward);
    backward.push_back(s.backward + s.backward_weight);
  }
  std::vector<std::vector<double>> stretch;
  for (const std::vector<double>& rank : per_rank) stretch.emplace_back(rank.begin() + first_pass, rank.begin() + end_pass);
  return stage_factors(forward, backward, stretch);
}

bool KernelCalibrator::core_factors_include_tensor_parallel() const {
  return clock_->stage_ranks() > 1 && clock_->stages_run_tensor_parallel();
}

double KernelCalibrator::speed_change(int first_passes) const {
  const auto& t = pass_seconds_;
  if (first_passes <= 0 || static_cast<std::size_t>(first_passes) >= t.size()) return 0;
  const double before = median({t.begin(), t.begin() + first_passes});
  const double after = median({t.begin() + first_passes, t.end()});
  return after / before - 1;
}

HardwareProfile calibrate_profile(const Backend& backend, const RuntimePlan& plan, const std::string& name,
                                  const CalibrateOptions& options, CommBenchResult* comm_table) {
  backend.require_available();
  if (!backend.kernels || !backend.describe)
    throw std::invalid_argument("calibrate: the " + backend.name + " backend has no calibration");
  HardwareProfile p = backend.describe(plan, name, options);
  {
    const std::unique_ptr<KernelCalibrator> kernels = backend.kernels(plan, options);
    if (options.progress)
      options.progress(fmt::format("timing {} kernels at the plan's shapes in {} on {}", kernels->num_kernels(),
                                   dtype_name(plan.plan.config.precision.compute), kernels->placement()));
    kernels->run_until_settled();
    p.kernels = kernels->rates();
    p.composition = kernels->composition();
    p.core_factors = kernels->core_factors();
    p.core_alone_factors = kernels->core_alone_factors(0, kernels->passes_done());
    p.optimizer_core_factors = kernels->optimizer_core_factors(0, kernels->passes_done());
    p.core_factors_include_tensor_parallel = kernels->core_factors_include_tensor_parallel();
  }
  // The other formats the backend runs, so that a scenario naming this profile may compute in
  // any of them: the same shapes in that format.
  for (DType d : options.precisions) {
    if (d == plan.plan.config.precision.compute || !backend.calibrates_format(d)) continue;
    RuntimePlan other = plan;
    ScenarioConfig c = plan.plan.config;
    c.precision.compute = d;
    other.plan = Plan::from_config(c);
    other.plan.runtime_decoder = true;
    const std::unique_ptr<KernelCalibrator> k = backend.kernels(other, options);
    if (options.progress) options.progress(fmt::format("timing {} kernels in {}", k->num_kernels(), dtype_name(d)));
    k->run_until_settled();
    for (const KernelRate& r : k->rates()) p.kernels.push_back(r);
  }
  calibrate_communication(backend, p, options, comm_table);
  return p;
}

void calibrate_communication(const Backend& backend, HardwareProfile& p, const CalibrateOptions& options,
                             CommBenchResult* comm_table) {
  if (!options.communication) return;
  if (!backend.comm_bench) throw std::invalid_argument("calibrate: the " + backend.name + " backend has no communication benchmark");
  if (options.progress) options.progress("point-to-point and all-reduce benchmarks" + backend.comm_where);
  const CommBenchResult comm = backend.comm_bench(options.comm, options.placement);
  apply_comm_bench(p, comm, backend.comm_where);
  p.allreduce_wire = options.comm.wire;
  if (comm_table) *comm_table = comm;
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
                              const std::vector<KernelRate>& rates, double forward_seconds, double backward_seconds,
                              double backward_weight_seconds) {
  ScenarioConfig c = config;
  c.parallelism.pipeline_parallel_size = 3;
  c.parallelism.data_parallel_size = 1;
  c.parallelism.zero_stage = 0;  // nothing to shard without replicas (and no framework refuses the pipeline)
  c.parallelism.framework = Framework::auto_select;
  c.parallelism.fsdp_no_sync = false;
  c.communication.overlap_param_gather = false;  // (the distributed optimizer's, with replicas only)
  c.parallelism.virtual_pipeline_stages = 1;
  c.parallelism.schedule = ScheduleKind::one_f_one_b;
  c.parallelism.layers_per_stage = {layers, layers, layers};
  c.model.num_layers = 3 * layers;
  c.cluster.num_gpus = c.cluster.gpus_per_node =
      3 * c.parallelism.tensor_parallel_size * c.parallelism.context_parallel_size;  // a shard's stages
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
  const double f = priced(middle.forward), bi = priced(middle.backward_input), bw = priced(middle.backward_weight);
  out.forward = f > 0 ? forward_seconds / f : 1;
  if (backward_weight_seconds > 0) {  // a split backward, each pass against its own kernels
    out.backward = bi > 0 ? backward_seconds / bi : 1;
    out.backward_weight = bw > 0 ? backward_weight_seconds / bw : 1;
  } else {
    out.backward = bi + bw > 0 ? backward_seconds / (bi + bw) : 1;
  }
  return out;
}

bool calibration_settled(const CalibrateOptions& options, const std::vector<double>& pass_seconds) {
  const auto passes = static_cast<int>(pass_seconds.size());
  double total = 0;
  for (double t : pass_seconds) total += t;
  return passes >= options.max_passes || (passes >= options.min_passes && total >= options.min_seconds);
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

void apply_comm_bench(HardwareProfile& p, const CommBenchResult& comm, const std::string& where) {
  p.p2p = comm.p2p;
  p.allreduce = comm.allreduce;
  p.p2p_table.rows.clear();
  p.allreduce_tables.clear();
  p.allgather_tables.clear();
  p.reduce_scatter_tables.clear();
  for (const CollectiveRow& r : comm.rows) {
    if (r.wrong != 0)
      throw std::runtime_error(fmt::format("calibrate: {} of {} bytes over {} ranks{} gave {} wrong elements", r.op,
                                           r.bytes, r.ranks, where, r.wrong));
    const std::pair<double, double> row{static_cast<double>(r.bytes), r.time_us * 1e-6};
    if (r.op == "sendrecv") p.p2p_table.rows.push_back(row);
    if (r.op == "all_reduce" && r.redop == "sum") p.allreduce_tables[r.ranks].rows.push_back(row);
    if (r.op == "all_gather") p.allgather_tables[r.ranks].rows.push_back(row);
    if (r.op == "reduce_scatter" && r.redop == "sum") p.reduce_scatter_tables[r.ranks].rows.push_back(row);
  }
}

}  // namespace trainsim::runtime
