#include "validation/validate.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <optional>
#include <ostream>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/kernel_inventory.h"
#include "core/median.h"
#include "core/metrics.h"
#include "core/report/format.h"
#include "core/report/report.h"
#include "runtime/comm/in_process.h"
#include "runtime/engine/zero.h"
#include "runtime/loop/run_loop.h"
#include "runtime/loop/run_report.h"
#include "sim/cost/collective_model.h"
#include "sim/cost/compute_model.h"
#include "validation/core_sharing.h"

namespace trainsim::validation {

namespace {

double relative(double predicted, double measured) {
  return measured != 0 ? (predicted - measured) / measured : (predicted == 0 ? 0.0 : INFINITY);
}

// The plan the simulator predicts: the executed plan with the profile applied like a preset.
Plan calibrated_plan(const runtime::RuntimePlan& rp, const HardwareProfile& profile) {
  ScenarioConfig c = rp.plan.config;
  apply_profile(profile, c.cluster);
  c.cluster.calibrated = std::make_shared<HardwareProfile>(profile);
  Plan plan = Plan::from_config(c);
  plan.source = rp.plan.source;
  plan.runtime_decoder = rp.plan.runtime_decoder;
  return plan;
}

// Group sizes the plan's collectives use: the data-parallel groups (dp x cp), the tensor- and
// context-parallel groups and every rank (the global overflow check and gradient norm).
std::vector<int> collective_group_sizes(const Plan& plan) {
  std::vector<int> g;
  for (int n : {plan.data_shards(), plan.num_ranks() * plan.gpus_per_rank(), plan.pp > 1 ? 2 : 1, plan.tp, plan.cp})
    if (n >= 2 && std::find(g.begin(), g.end(), n) == g.end()) g.push_back(n);
  std::sort(g.begin(), g.end());
  return g;
}

// Ranks that share cores by turns run one compute op per core at a time: every rank at the cores'
// mean speed side by side. Each op finds its core as another rank's op left it, which the factors
// (timed so) hold; a chunk's first forward of the step is colder still, after every rank's
// optimizer step streamed its weights and moments through the caches, and keeps the cold
// composition's price (Composition::first_forward): the incident's original measured it 0.31 ms a
// rank (+20%) over the warm price in five runs, every rank over (docs/validation.md, "Twenty-ninth
// session").
HardwareProfile turn_profile(HardwareProfile p, int ranks) {
  p.core_alone_factors.clear();
  p.optimizer_core_factors.clear();  // timed with a core each: not what turns on shared cores see
  if (!p.core_factors.empty()) {
    double mean = 0;
    for (double f : p.core_factors) mean += f / static_cast<double>(p.core_factors.size());
    p.core_factors.assign(static_cast<std::size_t>(ranks), mean);
  }
  return p;
}

// The passes that price the step the run reports (its median): those between the steps
// kStepWindowSteps before and after it. A shared host slows one core, or both, by 20-70% in bursts
// of a few to tens of passes; the median over the whole run then lands in or out of a burst by how
// many passes it covered, not by what the reported step met (core factors: a bubble 0.05 off in
// two runs of four; kernel rates: 9 of 32 step times beyond 15% of the accepted error on the
// thirteenth session's host against 1 of 32 from the window; docs/validation.md).
constexpr int kStepWindowSteps = 2;

// Per schedule rank of a plan whose ranks each compute on one core (no tensor parallelism): its
// transformer blocks' seconds per block in the reported step (RunReport::layer_seconds) over the
// mean of that over the ranks. Every rank's blocks are the same work (the same shapes, each
// through the same forward and backward passes, whatever stage holds it), so a rank whose blocks
// took longer ran on a slower core: a shared host moves one vCPU's speed against the other's by
// 20-40% within seconds, faster than the calibration passes between the steps follow (they read
// x1.07/x1.10 around a step whose blocks ran x1.00/x0.77), and which rank waits for the other,
// at a data-parallel all-reduce or a pipeline's send, follows it. Empty where the blocks were not
// timed, or for one rank.
std::vector<double> core_factors_in_step(const Plan& plan, const runtime::RunReport& measured) {
  const int ranks = plan.num_ranks();
  if (plan.tp != 1 || ranks < 2 || measured.layer_seconds.size() != measured.executed_ranks.size()) return {};
  std::vector<double> f(static_cast<std::size_t>(ranks), -1);
  for (std::size_t e = 0; e < measured.executed_ranks.size(); ++e) {
    const int r = measured.executed_ranks[e].schedule_rank;
    if (r >= 0 && r < ranks) f[static_cast<std::size_t>(r)] = measured.layer_seconds[e];
  }
  double mean = 0;
  for (double x : f) {
    if (!(x > 0)) return {};
    mean += x / static_cast<double>(ranks);
  }
  for (double& x : f) x /= mean;
  return f;
}

// The core factors and alone factors (HardwareProfile::core_factors, core_alone_factors) of passes
// [first, end), or of all passes where those hold none.
std::pair<std::vector<double>, std::vector<double>> step_core_factors(const runtime::KernelCalibrator& kernels,
                                                                      int first, int end) {
  if (std::vector<double> f = kernels.core_factors(first, end); !f.empty())
    return {std::move(f), kernels.core_alone_factors(first, end)};
  return {kernels.core_factors(), kernels.core_alone_factors(0, kernels.passes_done())};
}


// Per rank: it skipped its update in the run's measured step (an overflow under loss scaling). The
// step's timing is predicted for the branch its numerics took: no update where there was none.
std::vector<char> skipped_updates(const runtime::RunReport& r) {
  std::vector<char> out;
  const runtime::StepRecord* reported = runtime::reported_step(r);
  if (!reported) return out;
  for (const runtime::RankStepNumerics& n : reported->ranks) {
    if (static_cast<std::size_t>(n.rank) >= out.size()) out.resize(static_cast<std::size_t>(n.rank) + 1, 0);
    out[static_cast<std::size_t>(n.rank)] = n.skipped;
  }
  return out;
}

// How the run shares the cores (validation/core_sharing.h): where the optimizer step's gradient norm
// is all-reduced, that all-reduce's latency over every rank, who skipped its update.
CoreSharing sharing_of(const Plan& plan, const Schedule& schedule, const HardwareProfile& p,
                       std::vector<runtime::CoreTurn> turns, std::vector<char> skipped = {}) {
  CoreSharing sh;
  // A schedule rank's turn takes a core per shard, tensor- or context-parallel (the engine's CoreGate).
  sh.cores = std::max(1, p.ranks_per_node / plan.gpus_per_rank());
  sh.turns = std::move(turns);
  sh.optimizer_first_part = optimizer_norm_share(plan, p);
  sh.skipped_update = std::move(skipped);
  if (const auto it = p.allreduce.find(plan.num_ranks() * plan.gpus_per_rank()); it != p.allreduce.end())
    sh.norm_allreduce = seconds_to_ticks(it->second.latency_us * 1e-6);
  sh.handoff = seconds_to_ticks(p.core_handoff_us * 1e-6);
  // A rank's collectives run on its cores (the CPU backend's communication threads copy and sum
  // there), which the operating system shares with the turns.
  sh.collectives_take_cores = p.collectives_take_rank_core;
  // The in-process world's collectives are rings of steps, but for its small all-reduces (direct).
  const NetworkCollectiveModel collectives(plan);
  for (const Collective& c : schedule.collectives) {
    CoreSharing::Ring ring;
    ring.ring = c.kind != OpKind::AllReduce ||
                !runtime::all_reduce_goes_direct(c.members.size(), static_cast<std::size_t>(collectives.elements_per_call(c)));
    std::tie(ring.before, ring.after) = collectives.shard_copies(c);
    ring.threads = collectives.group_size(c);  // the table its price came from: one thread a GPU
    sh.rings.push_back(ring);
  }
  // Only the CPU engine shares cores by turns: its in-process world's receives copy the message out
  // on the receiving thread, which outside its turns runs first on its core where the ranks have
  // one shard a cell (cpu_turns_wait_first); with more, the woken thread waits as any other.
  sh.receiver_copies = plan.gpus_per_rank() == 1;
  sh.threads_per_turn = plan.gpus_per_rank();
  sh.host_cores = std::max(1, p.ranks_per_node);
  if (plan.gpus_per_rank() > sh.host_cores) {
    const RooflineComputeModel model(plan);
    for (const auto& prog : schedule.ranks) {
      std::vector<double>& ops = sh.unslowed.emplace_back();
      for (const Op& op : prog.ops) ops.push_back(model.collective_share(op));
    }
  }
  sh.zero3_units_held = runtime::kZero3UnitsHeld;
  sh.zero3_forward_keeps_first_unit = plan.num_virtual_stages() == 1 && plan.shape().tied;
  return sh;
}

std::string loss_text(double x) { return std::isfinite(x) ? fmt::format("{:.3f}", x) : std::isnan(x) ? "NaN" : "inf"; }

}  // namespace

// 0.2 where the profile prices none of the step's kernels.
double optimizer_norm_share(const Plan& plan, const HardwareProfile& p) {
  // The first stage's rank, as the compute model prices it (a share: the same on every stage).
  double first = 0, all = 0;
  for (const KernelWork& w : rank_update_kernels(plan, 0, p.emulated_low_precision)) {
    const double t = p.kernel_seconds(w.kernel, w.dtype, w.shape, w.bytes);
    if (t < 0) continue;
    all += w.count * t;
    if (w.kernel == kShardCopyKernel || w.kernel == "unscale" || w.kernel == "grad_norm") first += w.count * t;
  }
  return all > 0 ? first / all : 0.2;
}

std::string describe_numerics(const NumericsSummary& n) {
  std::string s = fmt::format("{} steps, loss {} -> {}", n.steps, loss_text(n.first_loss), loss_text(n.last_loss));
  if (n.skipped_steps) s += fmt::format(", {} skipped", n.skipped_steps);
  if (n.unguarded_steps)
    s += fmt::format(", inf/NaN reached the weights in {} step{} (the overflow check did not stop it)", n.unguarded_steps,
                     n.unguarded_steps > 1 ? "s" : "");
  if (n.split_skips)
    s += fmt::format(", {} step{} skipped by some ranks and applied by others", n.split_skips, n.split_skips > 1 ? "s" : "");
  if (n.first_nan_step) s += fmt::format(", first inf/NaN at step {} ({})", n.first_nan_step, n.first_nan_where);
  if (n.max_replica_drift > 0) s += fmt::format(", replicas drifted apart by up to {:.3g}", n.max_replica_drift);
  s += fmt::format(", final loss scale {:g}", n.final_loss_scale);
  return s + (n.stable ? ": stable" : ": UNSTABLE");
}

std::string backend_title(const std::string& backend) {
  for (const runtime::Backend* b : runtime::backends())
    if (b->name == backend) return b->title;
  return backend;
}

std::optional<std::pair<int, int>> passes_around_step(const runtime::RunReport& run,
                                                      const std::vector<int>& passes_after_step,
                                                      int passes_between_steps, int steps_each_side) {
  // Passes ran after every step the loop ran, replays included, in order.
  const auto steps = steps_around_step(run, static_cast<int>(passes_after_step.size()), steps_each_side);
  if (!steps) return std::nullopt;
  const auto after = [&](int k) { return passes_after_step[static_cast<std::size_t>(k)]; };
  const auto [before, last] = *steps;  // before: the step whose passes come just before the window's first
  const int first = before >= 0 ? after(before) : std::max(0, after(0) - passes_between_steps);
  return std::pair{first, after(last) + passes_between_steps};
}

double allreduce_around_step(const runtime::RunReport& run, int steps_each_side) {
  const std::vector<runtime::StepRecord> steps = runtime::steps_as_run(run);
  const int i = runtime::reported_step_index(run);
  std::vector<double> window;
  for (int k : runtime::timed_step_indices(steps))
    if (i >= 0 && std::abs(k - i) <= steps_each_side) window.push_back(steps[static_cast<std::size_t>(k)].allreduce_time_s);
  return window.empty() ? run.result.allreduce_time_s : median(std::move(window));
}

std::optional<std::pair<int, int>> steps_around_step(const runtime::RunReport& run, int steps_recorded,
                                                     int steps_each_side) {
  const int n = static_cast<int>(std::min(run.steps.size() + run.replayed_steps.size(),
                                          static_cast<std::size_t>(std::max(0, steps_recorded))));
  const int i = runtime::reported_step_index(run);
  if (i < 0 || i >= n) return std::nullopt;
  return std::pair{std::max(-1, i - steps_each_side - 1), std::min(i + steps_each_side, n - 1)};
}

NumericsSummary summarize_numerics(const runtime::RunReport& r) {
  NumericsSummary s;
  s.steps = static_cast<int>(r.steps.size());
  for (const auto& st : r.steps) {
    s.skipped_steps += st.skipped ? 1 : 0;
    s.split_skips += st.skipped_ranks > 0 && st.skipped_ranks < static_cast<int>(st.ranks.size()) ? 1 : 0;
    s.unguarded_steps += st.nonfinite_count > 0 && st.skipped_ranks < static_cast<int>(st.ranks.size()) ? 1 : 0;
    s.max_replica_drift = std::max(s.max_replica_drift, st.replica_drift);
    if (!s.first_nan_step && (!std::isfinite(st.loss) || st.nonfinite_count > 0)) {
      s.first_nan_step = st.step;
      for (const auto& rk : st.ranks)
        if (!rk.first_nonfinite.empty()) {
          s.first_nan_where = fmt::format("stage {} replica {}: {}", rk.stage, rk.replica, rk.first_nonfinite);
          break;
        }
    }
  }
  if (!r.steps.empty()) {
    s.final_loss_scale = r.steps.back().loss_scale;
    s.first_loss = r.steps.front().loss;
    s.last_loss = r.steps.back().loss;
  }
  if (r.failure) s.failure = r.failure->message;
  s.stable = !r.failure && s.skipped_steps == 0 && s.split_skips == 0 && s.unguarded_steps == 0 && s.first_nan_step == 0 && s.max_replica_drift == 0;
  return s;
}

CommunicationSizes communication_sizes(const Plan& plan) {
  std::set<std::size_t> sendrecv, all_reduce{8}, all_gather, reduce_scatter;
  const auto around = [](std::set<std::size_t>& rows, double bytes) {
    std::size_t b = 8;
    while (static_cast<double>(2 * b) <= bytes / 2) b *= 2;
    for (; static_cast<double>(b / 2) < 4 * bytes; b *= 2) rows.insert(b);
  };
  const Schedule s = build_schedule(plan);
  for (const Collective& c : s.collectives)
    if (c.bytes > 0)
      around(c.kind == OpKind::AllGather       ? all_gather
             : c.kind == OpKind::ReduceScatter ? reduce_scatter
                                               : all_reduce,
             static_cast<double>(c.bytes) / std::max(1, c.parts));
  for (const RankProgram& r : s.ranks)
    for (const Op& op : r.ops)
      if ((op.kind == OpKind::SendActivation || op.kind == OpKind::SendGradient) && op.bytes > 0)
        around(sendrecv, static_cast<double>(op.bytes));
  if (plan.tp > 1) {
    const TensorParallelBuffers tp = tensor_parallel_buffers(plan, plan.activation_bytes());
    if (plan.config.parallelism.sequence_parallel) {
      around(all_gather, tp.activation);
      around(reduce_scatter, tp.activation);
    } else {
      around(all_reduce, tp.activation);
    }
    for (double bytes : {tp.head_row_maxima, tp.head_row_sums, tp.norm_gradients, tp.final_norm_gradients})
      around(all_reduce, bytes);
  }
  return CommunicationSizes{{sendrecv.begin(), sendrecv.end()},
                            {all_reduce.begin(), all_reduce.end()},
                            {all_gather.begin(), all_gather.end()},
                            {reduce_scatter.begin(), reduce_scatter.end()}};
}

Validation validate(const Scenario& scenario, const ValidateOptions& o) {
  Validation v;
  v.plan = runtime::make_runtime_plan(scenario);
  auto say = [&](const std::string& s) {
    if (o.progress) o.progress(s);
  };

  runtime::CalibrateOptions co = o.calibrate;
  if (co.comm.group_sizes.empty()) co.comm.group_sizes = collective_group_sizes(v.plan.plan);
  co.communication = co.communication && !co.comm.group_sizes.empty();
  const CommunicationSizes sizes = communication_sizes(v.plan.plan);
  co.comm.sendrecv_sizes = sizes.sendrecv;
  co.comm.all_reduce_sizes = sizes.all_reduce;
  co.comm.all_gather_sizes = sizes.all_gather;
  co.comm.reduce_scatter_sizes = sizes.reduce_scatter;
  co.comm.sendrecv = !sizes.sendrecv.empty();
  // In the gradients' wire format: a 16-bit ring rounds every partial sum (the CPU backend
  // emulates the format, a pass the fp32 ring does not make).
  if (const DType wire = v.plan.plan.config.precision.allreduce; wire == DType::fp16 || wire == DType::bf16)
    co.comm.wire = wire;
  co.placement = o.backend.placement;
  runtime::RunOptions ro;
  ro.placement = o.backend.placement;
  ro.steps = o.steps;
  ro.timed_steps_at_least = runtime::kLeastDisturbedFrom;
  ro.synthetic_data = o.synthetic_data || scenario.config.runtime.data_synthetic;
  ro.data_path = o.data_path;

  v.backend = o.backend.name;
  const runtime::Backend& record = *o.backend.record;
  const bool stand_in = o.backend.run || o.backend.calibrate;
  // More ranks than cores, on a backend that shares them by turns: the order of the turns comes from
  // a prediction with the profile measured so far, and the run follows it.
  const auto shares_by_turns = [&](const HardwareProfile& p) {
    return record.shares_by_turns && !stand_in && v.plan.plan.num_ranks() * v.plan.plan.gpus_per_rank() > std::max(1, p.ranks_per_node);
  };
  auto run = [&](const HardwareProfile& before) {
    if (shares_by_turns(before)) {
      const HardwareProfile p = turn_profile(before, v.plan.plan.num_ranks() * v.plan.plan.gpus_per_rank());
      const Plan plan = calibrated_plan(v.plan, p);
      const Timeline alone = predict(plan).timeline;
      ro.core_turns = share_cores(alone, sharing_of(plan, *alone.schedule, p, {})).turns;
    }
    return o.backend.run ? o.backend.run(v.plan, ro) : runtime::run(record, v.plan, ro);
  };
  const std::string profile_name = o.backend.name + "-" + scenario.config.name;
  std::function<HardwareProfile(const runtime::RuntimePlan&, const runtime::CalibrateOptions&)> calibrate =
      o.backend.calibrate;
  if (!stand_in && record.kernels)
    calibrate = [&](const runtime::RuntimePlan& rp, const runtime::CalibrateOptions& options) {
      return runtime::calibrate_profile(record, rp, profile_name, options);
    };
  const bool between_steps = !stand_in && record.calibrate_between_steps && record.kernels;
  if (o.profile_path.empty() && !between_steps && !calibrate)
    throw std::invalid_argument("validate: the " + o.backend.name + " backend has no calibration; give a profile");

  if (!o.profile_path.empty()) {
    say("loading the hardware profile " + o.profile_path);
    v.profile = load_profile(o.profile_path);
    say("running");
    v.measured = run(v.profile);
  } else if (!between_steps) {
    say("calibrating the " + o.backend.name + " backend at the plan's shapes");
    co.progress = o.progress;
    co.precisions = {v.plan.plan.config.precision.compute};  // the run's format only
    v.profile = calibrate(v.plan, co);
    say("running");
    v.measured = run(v.profile);
  } else {
    // Calibrate before the run and between its steps, so that the kernels' rates and the
    // run come from the same stretch of a machine whose speed may wander.
    say("calibrating the " + backend_title(o.backend.name) + " backend at the plan's shapes");
    co.progress = o.progress;
    v.profile = record.describe(v.plan, profile_name, co);
    runtime::calibrate_communication(record, v.profile, co);
    const std::unique_ptr<runtime::KernelCalibrator> kernels = record.kernels(v.plan, co);
    // The rates the prediction takes come from the passes around the step the run reports (below).
    // Before the run, ranks that share cores by turns need settled rates for the order of their
    // turns; other plans only a reference for the machine's drift.
    if (shares_by_turns(v.profile))
      kernels->run_until_settled();
    else
      kernels->run_passes(o.passes_before_run);
    const int before = kernels->passes_done();
    std::vector<int> passes_after_step;  // [i]: passes done when the run's i-th step ended
    // The communication benchmark's rows again after every step, a few calls each: a shared host
    // moves a collective's time by as much as a kernel's (dp2-fp32's all-reduce: a median of 626 us
    // over one run's steps, 831 us over the next run's; docs/validation.md).
    std::vector<std::optional<runtime::CommBenchResult>> comm_after_step;  // [i]: the rows run after the run's i-th step
    double comm_rerun_s = 0;
    runtime::CommBenchOptions comm_between = co.comm;
    comm_between.iters = o.comm_calls_between_steps;
    comm_between.warmup_iters = 1;
    comm_between.on_row = nullptr;
    // Ranks that take the cores in turns keep the rows from before the run: their collectives are
    // priced from those with the turns' sharing (core_sharing.h), and the rows of groups wider than
    // the cores would add a third to the run's time.
    const bool comm_between_steps =
        co.communication && record.comm_bench && o.comm_calls_between_steps > 0 && !shares_by_turns(v.profile);
    ro.on_step = [&](const runtime::StepRecord&) {
      passes_after_step.push_back(kernels->passes_done());
      kernels->run_passes(o.passes_between_steps);
      if (!comm_between_steps || comm_rerun_s >= o.comm_rerun_budget_s) {
        comm_after_step.emplace_back();
        return;
      }
      const auto t0 = std::chrono::steady_clock::now();
      comm_after_step.push_back(record.comm_bench(comm_between, co.placement));
      comm_rerun_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    say("running, with calibration passes between steps");
    HardwareProfile settled = v.profile;
    settled.kernels = kernels->rates();
    settled.composition = kernels->composition();
    settled.core_factors = kernels->core_factors();
    v.measured = run(settled);
    // The kernels' rates, composition and cores' factors of the passes around the step the run
    // reports: the machine as it ran then (a shared host's speed wanders by 10-30% within a run).
    const auto window = passes_around_step(v.measured, passes_after_step, o.passes_between_steps, kStepWindowSteps);
    const auto [first, end] = window.value_or(std::pair{0, kernels->passes_done()});
    v.profile.kernels = kernels->rates(first, end);
    v.profile.composition = kernels->composition(first, end);
    std::tie(v.profile.core_factors, v.profile.core_alone_factors) = step_core_factors(*kernels, first, end);
    v.profile.optimizer_core_factors = kernels->optimizer_core_factors(first, end);
    v.profile.core_factors_include_tensor_parallel = kernels->core_factors_include_tensor_parallel();
    // The collectives' rows likewise: those run after the steps of the same window.
    if (const auto steps = steps_around_step(v.measured, static_cast<int>(comm_after_step.size()), kStepWindowSteps)) {
      std::vector<runtime::CommBenchResult> runs;
      for (int k = std::max(0, steps->first); k <= steps->second; ++k)
        if (comm_after_step[static_cast<std::size_t>(k)]) runs.push_back(*comm_after_step[static_cast<std::size_t>(k)]);
      if (!runs.empty()) runtime::apply_comm_bench(v.profile, runtime::median_of_runs(runs), record.comm_where);
    }
    v.machine_drift = kernels->speed_change(before);
    v.drift_measured = true;
  }
  v.numerics = summarize_numerics(v.measured);
  v.allreduce_window_s = allreduce_around_step(v.measured, kStepWindowSteps);

  say("predicting");
  const int cores = std::max(1, v.profile.ranks_per_node);
  const int ranks = v.plan.plan.num_ranks() * v.plan.plan.gpus_per_rank();  // every shard is a thread
  if (shares_by_turns(v.profile)) {
    // Op by op, with the profile measured during the run, in the order of turns the run followed.
    v.profile = turn_profile(v.profile, ranks);
    const Plan plan = calibrated_plan(v.plan, v.profile);
    v.predicted = predict(plan);
    v.predicted.timeline =
        share_cores(v.predicted.timeline,
                    sharing_of(plan, *v.predicted.timeline.schedule, v.profile, ro.core_turns, skipped_updates(v.measured)))
            .timeline;
    v.predicted.result = compute_result(plan, v.predicted.timeline, v.predicted.memory);
    v.oversubscribed = true;
    return v;
  }
  // The plan predicted with v.profile, on the branch the measured step's numerics took.
  const auto predict_step = [&] {
    const Plan plan = calibrated_plan(v.plan, v.profile);
    v.predicted = predict(plan);
    // A rank that skipped its update in the measured step: its optimizer step (the step's last op,
    // nothing waits for it) ends with the gradient norm.
    const std::vector<char> skipped = skipped_updates(v.measured);
    const double share = optimizer_norm_share(plan, v.profile);
    bool any = false;
    for (std::size_t r = 0; r < skipped.size() && r < v.predicted.timeline.ops.size(); ++r) {
      if (!skipped[r]) continue;
      const auto& ops = v.predicted.schedule->ranks[r].ops;
      for (std::size_t i = 0; i < ops.size(); ++i)
        if (ops[i].kind == OpKind::OptimizerStep) {
          OpTiming& t = v.predicted.timeline.ops[r][i];
          t.end = t.start + static_cast<Tick>(std::llround(static_cast<double>(t.end - t.start) * share));
          any = true;
        }
    }
    if (any) v.predicted.result = compute_result(plan, v.predicted.timeline, v.predicted.memory);
  };
  predict_step();
  // Ranks on cores of their own: each core's speed relative to the others as the measured step's
  // blocks found it (core_factors_in_step), the mean speed still the calibration's.
  if (ranks <= cores && !v.profile.core_factors.empty())
    if (const std::vector<double> f = core_factors_in_step(v.plan.plan, v.measured); !f.empty()) {
      // Each rank's core at the cores' calibrated mean times its own in the step; alone (the
      // other cores idle) as much faster than beside the others as the calibration found it.
      const HardwareProfile calibrated = v.profile;
      double mean = 0;
      for (std::size_t r = 0; r < f.size(); ++r)
        mean += calibrated.core_factor(v.plan.plan.first_gpu_of(static_cast<int>(r))) / static_cast<double>(f.size());
      for (std::size_t r = 0; r < f.size(); ++r) {
        const int core = v.plan.plan.first_gpu_of(static_cast<int>(r));
        const auto at = static_cast<std::size_t>(core) % v.profile.core_factors.size();
        v.profile.core_factors[at] = mean * f[r];
        if (!v.profile.core_alone_factors.empty())
          v.profile.core_alone_factors[static_cast<std::size_t>(core) % v.profile.core_alone_factors.size()] =
              mean * f[r] * calibrated.core_alone_factor(core) / calibrated.core_factor(core);
      }
      v.core_factors_in_step = f;
      predict_step();
    }
  // More ranks than cores on a backend whose ranks run at once: a compute op stretches by how many
  // ranks are busy per device. Processor sharing, averaged over the step: every rank's compute
  // scales by (ranks x mean utilization) / cores, the utilization taken from the prediction itself
  // until it settles (a few rounds).
  if (ranks > cores && v.profile.core_factors.empty()) {
    for (int round = 0; round < 4; ++round) {
      const double busy = ranks * (1.0 - v.predicted.result.bubble_fraction) / cores;
      v.profile.core_factors.assign(ranks, std::max(1.0, busy));
      v.predicted = predict(calibrated_plan(v.plan, v.profile));
    }
    v.oversubscribed = true;
  }
  return v;
}

std::vector<MetricError> errors_of(const Validation& v) {
  const Result& p = v.predicted.result;
  const Result& m = v.measured.result;
  std::vector<MetricError> e;
  e.push_back({"step_time_s", p.step_time_s, m.step_time_s, relative(p.step_time_s, m.step_time_s), true});
  e.push_back({"bubble_fraction", p.bubble_fraction, m.bubble_fraction, p.bubble_fraction - m.bubble_fraction, false});
  e.push_back({"allreduce_time_s", p.allreduce_time_s, v.allreduce_window_s,
               relative(p.allreduce_time_s, v.allreduce_window_s), true});
  // The bubble's two parts (docs/model.md, "Idle time"), so a bubble error says which one is
  // off; after the first three, which baselines.cpp reads by position.
  e.push_back({"pipeline_bubble_fraction", p.pipeline_bubble_fraction, m.pipeline_bubble_fraction,
               p.pipeline_bubble_fraction - m.pipeline_bubble_fraction, false});
  e.push_back({"exposed_comm_fraction", p.exposed_comm_fraction, m.exposed_comm_fraction,
               p.exposed_comm_fraction - m.exposed_comm_fraction, false});
  for (std::size_t r = 0; r < std::min(p.ranks.size(), m.ranks.size()); ++r) {
    const RankResult &a = p.ranks[r], &b = m.ranks[r];
    e.push_back({fmt::format("rank {} utilization", r), a.utilization, b.utilization, a.utilization - b.utilization,
                 false});
    e.push_back({fmt::format("rank {} peak_memory", r), a.peak_memory_bytes, b.peak_memory_bytes,
                 relative(a.peak_memory_bytes, b.peak_memory_bytes), true});
  }
  return e;
}

double peak_memory_error(const Validation& v) {
  double worst = 0;
  for (const MetricError& e : errors_of(v))
    if (e.metric.find("peak_memory") != std::string::npos && std::abs(e.error) > std::abs(worst)) worst = e.error;
  return worst;
}

std::vector<OpKindTime> time_by_op_kind(const Validation& v) {
  std::vector<OpKindTime> rows;
  const Schedule* ps = v.predicted.schedule.get();
  const Schedule* ms = v.measured.timeline.schedule ? v.measured.timeline.schedule.get() : v.measured.schedule.get();
  if (!ps || !ms) return rows;
  const auto& pt = v.predicted.timeline.ops;
  const auto& mt = v.measured.timeline.ops;
  for (std::size_t r = 0; r < ps->ranks.size() && r < ms->ranks.size() && r < pt.size() && r < mt.size(); ++r) {
    const auto& ops = ps->ranks[r].ops;
    const auto& other = ms->ranks[r].ops;
    bool same = ops.size() == other.size() && pt[r].size() == ops.size() && mt[r].size() == ops.size();
    for (std::size_t i = 0; same && i < ops.size(); ++i)
      same = ops[i].kind == other[i].kind && ops[i].microbatch == other[i].microbatch && ops[i].chunk == other[i].chunk;
    if (!same) continue;
    const std::size_t first_row = rows.size();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      std::string kind;
      if (op.kind == OpKind::Forward && op.microbatch == 0) {
        kind = "F first";
      } else {
        for (char c : op_label(op))
          if (!std::isdigit(static_cast<unsigned char>(c))) kind += c;
        while (!kind.empty() && kind.back() == ' ') kind.pop_back();
      }
      auto it = std::find_if(rows.begin() + static_cast<std::ptrdiff_t>(first_row), rows.end(),
                             [&](const OpKindTime& x) { return x.kind == kind; });
      if (it == rows.end()) {
        rows.push_back({static_cast<int>(r), kind, 0, 0, 0});
        it = rows.end() - 1;
      }
      const OpTiming& a = pt[r][i];
      const OpTiming& b = mt[r][i];
      it->count += 1;
      it->predicted_s += ticks_to_seconds(a.end - a.start - a.waited);
      it->measured_s += ticks_to_seconds(b.end - b.start - b.waited);
      it->predicted_waited_s += ticks_to_seconds(a.waited);
      it->measured_waited_s += ticks_to_seconds(b.waited);
    }
  }
  return rows;
}

std::string format_time_by_op_kind(const std::vector<OpKindTime>& rows) {
  // The waits' columns only where some op waited.
  const bool waits = std::any_of(rows.begin(), rows.end(),
                                 [](const OpKindTime& x) { return x.predicted_waited_s > 0 || x.measured_waited_s > 0; });
  std::string o = fmt::format("  {:<6} {:<16} {:>6} {:>14} {:>14} {:>9}", "rank", "op", "count", "predicted",
                              "measured", "error");
  o += waits ? fmt::format(" {:>14} {:>14}\n", "waited (pred)", "waited (meas)") : "\n";
  for (const OpKindTime& x : rows) {
    o += fmt::format("  {:<6} {:<16} {:>6} {:>14} {:>14} {:>9}", x.rank, x.kind, x.count,
                     format_seconds(x.predicted_s), format_seconds(x.measured_s),
                     x.measured_s > 0 ? fmt::format("{:+.1f}%", 100 * (x.predicted_s / x.measured_s - 1)) : "-");
    o += waits ? fmt::format(" {:>14} {:>14}\n", format_seconds(x.predicted_waited_s),
                             format_seconds(x.measured_waited_s))
               : "\n";
  }
  return o;
}

std::string format_validation(const Validation& v) {
  const Plan& plan = v.plan.plan;
  std::ostringstream out;
  out << fmt::format("{} — predicted with the calibrated profile vs measured on the {} backend\n",
                     plan.config.name, backend_title(v.backend));
  out << fmt::format("  profile  {} ({}, measured {}): {} kernels, in-layer composition x{:.2f} forward{}, x{:.2f} "
                     "backward{}{}{}\n",
                     v.profile.name, v.profile.device, v.profile.measured, v.profile.kernels.size(),
                     v.profile.composition.forward,
                     v.profile.composition.first_forward > 0
                         ? fmt::format(" (a step's first x{:.2f})", v.profile.composition.first_forward)
                         : std::string(),
                     v.profile.composition.backward,
                     v.profile.composition.backward_weight > 0
                         ? fmt::format(" input pass, x{:.2f} weight pass", v.profile.composition.backward_weight)
                         : std::string(),
                     v.profile.core_factors.empty()
                         ? std::string()
                         : fmt::format(", cores x{:.2f}{}", fmt::join(v.profile.core_factors, "/x"),
                                       v.profile.core_alone_factors.empty()
                                           ? std::string()
                                           : fmt::format(" (alone x{:.2f})", fmt::join(v.profile.core_alone_factors, "/x"))),
                     v.profile.optimizer_core_factors.empty()
                         ? std::string()
                         : fmt::format(", updates x{:.2f}", fmt::join(v.profile.optimizer_core_factors, "/x")));
  out << fmt::format("  plan     data {} x pipeline {}{}{}, {} schedule, {} micro-batches of {}, {}, {} compute\n",
                     plan.dp, plan.pp,
                     plan.tp > 1 ? fmt::format(" x tensor {}{}", plan.tp,
                                               plan.config.parallelism.sequence_parallel ? " (sequence parallel)" : "")
                                 : "",
                     plan.cp > 1 ? fmt::format(" x context {}", plan.cp) : "",
                     schedule_name(plan.config.parallelism.schedule), plan.num_microbatches,
                     plan.micro_batch_size, plan.zero_and_recompute(), dtype_name(plan.config.precision.compute));
  if (v.oversubscribed) {
    out << fmt::format("  cores    {} ranks share {} cores: ops take them in turns, in the order predicted; "
                       "{:.0f} us per handoff of a core (calibrated on the engine's gate)\n",
                       v.plan.plan.num_ranks() * v.plan.plan.gpus_per_rank(), v.profile.ranks_per_node, v.profile.core_handoff_us);
    if (v.plan.plan.gathers_before_backward() && v.plan.plan.data_shards() > 1)
      out << fmt::format("           ZeRO-3: a pass waits for each unit's gather with its {} data-parallel peers, {} "
                         "units held at most; a rank waiting for one gives its core back\n",
                         v.plan.plan.data_shards() - 1, runtime::kZero3UnitsHeld);
    // The core-sharing model time-shares a turn's cores among its shards (CoreSharing::host_cores).
    if (v.plan.plan.gpus_per_rank() > v.profile.ranks_per_node)
      out << fmt::format("           a schedule rank's {} shards outnumber the {} cores: a turn runs its kernels at {}/{} "
                         "of their speed alone (its collectives at their tables' time); with a few rows a shard "
                         "its kernels are priced high (docs/validation.md, \"Context parallelism on the runtime\")\n",
                         v.plan.plan.gpus_per_rank(), v.profile.ranks_per_node, v.profile.ranks_per_node,
                         v.plan.plan.gpus_per_rank());
  }
  if (v.profile.comm_wake_us > 0)
    out << fmt::format("  comm     a collective whose first member waited over {:.0f} us (its poll) pays {:.0f} us more for "
                       "its sleep (calibrated)\n",
                       v.profile.comm_poll_us, v.profile.comm_wake_us);
  if (!v.profile.comm_late.empty()) {
    std::vector<std::string> points;
    for (const HardwareProfile::LatePoint& l : v.profile.comm_late) points.push_back(fmt::format("{:.1f} ms {:.1f} us", l.lead_us * 1e-3, l.us));
    out << fmt::format("  comm     a collective whose first member arrived earlier pays more, by its lead: {} (calibrated)\n",
                       fmt::join(points, ", "));
  }
  if (!v.core_factors_in_step.empty())
    out << fmt::format("  in step  the ranks' blocks took x{:.2f} of their mean per block in the measured step: the "
                       "cores' factors above include it\n",
                       fmt::join(v.core_factors_in_step, "/x"));
  if (v.drift_measured)
    out << fmt::format("  machine  speed moved by {:+.1f}% during the run (calibration passes between steps vs before)\n",
                       100 * v.machine_drift);
  const std::vector<runtime::StepRecord> steps = runtime::steps_as_run(v.measured);
  if (!v.measured.replayed_steps.empty()) {
    const std::size_t own = runtime::timed_step_indices(v.measured.steps).size();
    const int replays = v.measured.replayed_steps.back().replay;
    out << fmt::format("  replays  the numerics ended the run at step {} with {} timed step{}: its steps ran {} more time{} "
                       "from the same state, with the same losses, for their timing (the reported step is the median of "
                       "{})\n",
                       v.measured.steps.back().step, own, own == 1 ? "" : "s", replays, replays == 1 ? "" : "s",
                       runtime::timed_step_indices(steps).size());
  }
  // What other work (processes, the kernel's threads, the hypervisor) took from the ranks' cores.
  const runtime::StepRecord* reported = runtime::reported_step(v.measured);
  if (reported && reported->foreign_seconds >= 0) {
    double most = 0;
    for (int i : runtime::timed_step_indices(steps)) most = std::max(most, steps[i].foreign_seconds / steps[i].step_time_s);
    out << fmt::format("  host     other work held a rank's core {:.1f}% of the reported step (step {}{}), at most "
                       "{:.1f}% of one step{}\n",
                       100 * reported->foreign_seconds / reported->step_time_s, reported->step,
                       reported->replay ? fmt::format(" of replay {}", reported->replay) : "", 100 * most,
                       runtime::chosen_by_host_share(steps) ? "; the steps it took most from are left out" : "");
  }
  // The all-reduce of every timed step: how far the reported step's figure sits in the run's own spread.
  if (reported) {
    std::vector<double> all_reduce;
    for (int i : runtime::timed_step_indices(steps)) all_reduce.push_back(steps[i].allreduce_time_s);
    const auto [lo, hi] = std::minmax_element(all_reduce.begin(), all_reduce.end());
    if (all_reduce.size() > 1 && *hi > 0)
      out << fmt::format("  steps    all-reduce {} to {} over the {} timed steps, median {}; the reported step's {}, the "
                         "median of the timed steps within {} of it {} (measured, below)\n",
                         format_seconds(*lo), format_seconds(*hi), all_reduce.size(), format_seconds(median(all_reduce)),
                         format_seconds(reported->allreduce_time_s), kStepWindowSteps,
                         format_seconds(v.allreduce_window_s));
  }
  out << "\n";
  out << fmt::format("  {:<24} {:>14} {:>14} {:>10}\n", "", "predicted", "measured", "error");
  auto seconds = [](double s) { return format_seconds(s); };
  for (const MetricError& e : errors_of(v)) {
    const bool memory = e.metric.find("memory") != std::string::npos;
    const bool time = e.metric.find("_s") != std::string::npos;
    std::string a, b;
    if (memory)
      a = fmt::format("{:.2f} MiB", e.predicted / (1 << 20)), b = fmt::format("{:.2f} MiB", e.measured / (1 << 20));
    else if (time)
      a = seconds(e.predicted), b = seconds(e.measured);
    else
      a = fmt::format("{:.1f}%", 100 * e.predicted), b = fmt::format("{:.1f}%", 100 * e.measured);
    const std::string err = e.relative ? (std::isfinite(e.error) ? fmt::format("{:+.1f}%", 100 * e.error) : "n/a")
                                       : fmt::format("{:+.3f}", e.error);
    out << fmt::format("  {:<24} {:>14} {:>14} {:>10}\n", e.metric, a, b, err);
  }
  const NumericsSummary& n = v.numerics;
  out << "\n  numerics " << describe_numerics(n) << "\n";
  if (!n.failure.empty()) out << "           " << n.failure << "\n";
  for (const auto& note : v.plan.notes) out << "  note     runtime: " << note << "\n";
  return out.str();
}

nlohmann::ordered_json validation_to_json(const Validation& v) {
  nlohmann::ordered_json j;
  j["scenario"] = v.plan.plan.config.name;
  j["profile"] = v.profile.name;
  j["backend"] = v.backend;
  j["predicted"] = result_to_json(v.predicted.result);
  j["measured"] = runtime::run_to_json(v.measured);
  j["measured_allreduce_window_s"] = round6(v.allreduce_window_s);  // what error.allreduce_time_s is against
  const std::vector<MetricError> all = errors_of(v);
  nlohmann::ordered_json err;
  for (const MetricError& e : all) {
    if (e.metric.rfind("rank ", 0) == 0) continue;
    err[e.metric] = std::isfinite(e.error) ? nlohmann::ordered_json(round6(e.error)) : nlohmann::ordered_json(nullptr);
  }
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (std::size_t r = 0; r < v.predicted.result.ranks.size(); ++r) {
    nlohmann::ordered_json x;
    x["rank"] = r;
    for (const MetricError& e : all)
      if (e.metric.rfind(fmt::format("rank {} ", r), 0) == 0)
        x[e.metric.substr(e.metric.find(' ', 5) + 1)] = round6(e.error);
    ranks.push_back(x);
  }
  err["ranks"] = ranks;
  j["error"] = err;
  nlohmann::ordered_json by_op = nlohmann::ordered_json::array();
  for (const OpKindTime& x : time_by_op_kind(v))
    by_op.push_back({{"rank", x.rank},
                     {"op", x.kind},
                     {"count", x.count},
                     {"predicted_s", round6(x.predicted_s)},
                     {"measured_s", round6(x.measured_s)},
                     {"predicted_waited_s", round6(x.predicted_waited_s)},
                     {"measured_waited_s", round6(x.measured_waited_s)}});
  j["by_op"] = by_op;
  const NumericsSummary& n = v.numerics;
  j["numerics"] = {{"stable", n.stable},
                   {"steps", n.steps},
                   {"skipped_steps", n.skipped_steps},
                   {"split_skip_steps", n.split_skips},
                   {"unguarded_nonfinite_steps", n.unguarded_steps},
                   {"first_nan_step", n.first_nan_step ? nlohmann::ordered_json(n.first_nan_step) : nullptr},
                   {"first_nan_where", n.first_nan_where},
                   {"final_loss_scale", n.final_loss_scale},
                   {"max_replica_drift", n.max_replica_drift}};
  j["machine_drift"] = v.drift_measured ? nlohmann::ordered_json(round6(v.machine_drift)) : nlohmann::ordered_json(nullptr);
  if (!v.core_factors_in_step.empty()) j["core_factors_in_step"] = v.core_factors_in_step;
  return j;
}

void write_validation_trace(const Validation& v, std::ostream& out) {
  write_chrome_traces(v.plan.plan, {{"predicted", &v.predicted.timeline}, {"measured", &v.measured.timeline}}, out);
}

void write_validation_svg(const Validation& v, std::ostream& out) {
  const Tick span = std::max(v.predicted.timeline.end() - v.predicted.timeline.begin(),
                             v.measured.timeline.end() - v.measured.timeline.begin());
  std::ostringstream a, b;
  write_timeline_svg(v.plan.plan, v.predicted.timeline, v.predicted.result, a, span);
  write_timeline_svg(v.plan.plan, v.measured.timeline, v.measured.result, b, span);
  stack_svgs({a.str(), b.str()}, out);
}

}  // namespace trainsim::validation
