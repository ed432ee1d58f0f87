#include "runtime/loop/run_loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "core/metrics.h"
#include "runtime/checkpoint.h"
#include "runtime/engine/rank_threads.h"
#include "runtime/engine/weights.h"

namespace trainsim::runtime {

RunReport run(const Backend& backend, const RuntimePlan& rp, const RunOptions& options) {
  backend.require_available();
  RunReport report;
  report.runtime_plan = rp;
  report.backend = backend.name;
  report.backend_title = backend.title;
  const Plan& plan = report.runtime_plan.plan;
  const int steps = options.steps > 0 ? options.steps : plan.config.runtime.steps;
  const auto samples_per_step = static_cast<std::uint64_t>(plan.global_batch_size);
  const std::string fingerprint = plan_fingerprint(rp);

  // The data and the engine that runs the steps.
  const Dataset data = open_run_data(rp, options, report.data_source);
  const std::unique_ptr<DeviceEngine> engine = backend.engine(report.runtime_plan, data, options);
  const World& world = engine->world();
  report.schedule = engine->schedule();
  const Execution execution = engine->execution();
  report.execution = execution.text;
  report.ranks_as = execution.ranks_as;
  report.threads_pinned = execution.threads_pinned;

  // Resume: every backend writes and reads the same checkpoint format, so any resumes any other's.
  int first = 1;
  if (!options.resume_from.empty()) {
    const Checkpoint ck = load_checkpoint(options.resume_from, fingerprint);
    if (static_cast<int>(ck.ranks.size()) != world.size())
      throw CheckpointError(fmt::format("checkpoint has {} ranks, the plan {}", ck.ranks.size(), world.size()));
    engine->restore(ck);
    first = ck.step + 1;
  }
  report.first_step = first;

  // Where replays may be needed, the state they start from (restore reads its ranks' state only;
  // each replayed step is given its data position as the run's was).
  std::optional<Checkpoint> initial;
  if (options.timed_steps_at_least > 0) initial = Checkpoint{fingerprint, first - 1, 0, 0, engine->save()};

  std::vector<Timeline> timelines;                 // per step run, replays included
  std::vector<std::vector<double>> layer_seconds;  // per step run, per rank
  // One optimizer step on every rank: its record, and its timeline and blocks' seconds kept.
  // nullopt when a rank failed (a communication timeout, a device error, a bug): that ends the run
  // with its error. One failure fails the others (their collectives are aborted): the cause is the
  // earliest (RankStep::failed_at_ns; unstamped ones count as latest, ties go to the lowest rank).
  auto run_one = [&](int step, std::string* first_nonfinite) -> std::optional<StepRecord> {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<RankStep> ranks = engine->run_step(step, static_cast<std::uint64_t>(step - 1) * samples_per_step);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int failed = -1;
    auto stamp = [&](int r) {
      const std::int64_t t = ranks[static_cast<std::size_t>(r)].failed_at_ns;
      return t > 0 ? t : std::numeric_limits<std::int64_t>::max();
    };
    for (int r = 0; r < world.size(); ++r)
      if (!ranks[static_cast<std::size_t>(r)].error.empty() && (failed < 0 || stamp(r) < stamp(failed))) failed = r;
    if (failed >= 0) {
      report.failure = RunFailure{step, fmt::format("rank {} failed at step {}: {}", failed, step,
                                                    ranks[static_cast<std::size_t>(failed)].error)};
      return std::nullopt;
    }
    // What it measured: the step's timeline and numerics, and the replicas' weights.
    timelines.push_back(measured_timeline(report.schedule, cell_steps(world, ranks)));
    layer_seconds.emplace_back();
    for (const RankStep& r : ranks) layer_seconds.back().push_back(r.layer_seconds);
    StepRecord rec = step_record(step, seconds, ranks, first_nonfinite);
    rec.allreduce_time_s = compute_result(plan, timelines.back(), {}).allreduce_time_s;
    std::vector<std::uint64_t> hashes;
    for (const RankStep& r : ranks) hashes.push_back(r.weights_hash);
    rec.replica_checksums = replica_checksums(world, hashes, plan.zero() >= 1);
    const std::optional<double> drift = engine->replica_drift();
    const bool identical = std::all_of(rec.replica_checksums.begin(), rec.replica_checksums.end(),
                                       [&](std::uint64_t h) { return h == rec.replica_checksums[0]; });
    // Replicas differ, by how much is only known when all ranks are at hand.
    rec.replica_drift = drift ? *drift : identical ? 0.0 : INFINITY;
    return rec;
  };

  LossWatch loss_watch;
  bool numerics_ended = false;
  for (int step = first; step <= steps; ++step) {
    std::string first_nonfinite;
    std::optional<StepRecord> rec = run_one(step, &first_nonfinite);
    if (!rec) break;
    if (options.on_step) options.on_step(*rec);
    report.steps.push_back(*rec);

    // Stop a run that went numerically wrong; checkpoint one that did not.
    report.failure = loss_watch.check(*rec, first, first_nonfinite);
    numerics_ended = report.failure.has_value();
    if (checkpoint_due(options, step, steps) && !report.failure) {
      Checkpoint ck;
      ck.fingerprint = fingerprint;
      ck.step = step;
      ck.data_position = static_cast<std::uint64_t>(step) * samples_per_step;
      ck.seed = static_cast<std::uint64_t>(plan.config.runtime.seed);
      ck.ranks = engine->save();
      if (engine->writes_files()) report.checkpoints.push_back(save_checkpoint(options.checkpoint_dir, ck));
    }
    if (report.failure) break;
  }

  // A run its numerics ended early replays its steps for their timing (RunOptions::timed_steps_at_least).
  // The same state, data and steps give the same numerics; a replay that does not is dropped, and
  // no other follows it.
  const auto same = [](const StepRecord& a, const StepRecord& b) {
    const bool same_loss = a.loss == b.loss || (std::isnan(a.loss) && std::isnan(b.loss));
    return same_loss && a.skipped_ranks == b.skipped_ranks && a.nonfinite_count == b.nonfinite_count;
  };
  const std::optional<RunFailure> ended_by = report.failure;
  const std::size_t most_replays = options.timed_steps_at_least;  // a replay times at least one step
  for (std::size_t replay = 1;
       initial && numerics_ended && replay <= most_replays &&
       timed_step_indices(steps_as_run(report)).size() < options.timed_steps_at_least;
       ++replay) {
    engine->restore(*initial);
    std::vector<StepRecord> ran;
    bool kept = true;
    for (const StepRecord& original : report.steps) {
      std::optional<StepRecord> rec = run_one(original.step, nullptr);
      kept = rec && same(*rec, original);
      if (!rec) break;
      rec->replay = static_cast<int>(replay);
      if (options.on_step) options.on_step(*rec);
      ran.push_back(std::move(*rec));
      if (!kept) break;
    }
    if (!kept) {
      // Its timelines were kept as it ran: take them back.
      timelines.resize(timelines.size() - ran.size());
      layer_seconds.resize(layer_seconds.size() - ran.size());
      break;
    }
    report.replayed_steps.insert(report.replayed_steps.end(), ran.begin(), ran.end());
  }
  report.failure = ended_by;  // a replay's rank failure only ends the replays

  // The result: the median step's timeline, through the simulator's own metrics.
  const std::vector<StepRecord> as_run = steps_as_run(report);
  if (const int chosen = median_step_index(as_run); chosen >= 0) {
    report.timeline = timelines[static_cast<std::size_t>(chosen)];
    report.layer_seconds = layer_seconds[static_cast<std::size_t>(chosen)];
    report.timeline_step = as_run[static_cast<std::size_t>(chosen)].step;
    report.timeline_replay = as_run[static_cast<std::size_t>(chosen)].replay;
  } else {
    report.timeline.schedule = report.schedule;
    report.timeline.predicted = false;
    report.timeline.ops.assign(report.schedule->ranks.size(), {});
    for (std::size_t r = 0; r < report.schedule->ranks.size(); ++r)
      report.timeline.ops[r].assign(report.schedule->ranks[r].ops.size(), {});
  }
  // Memory per rank as the engine ran them, and per schedule rank (its largest shard) for the result.
  const std::vector<MemoryBreakdown> peaks = engine->memory_peaks();
  report.memory.assign(static_cast<std::size_t>(world.num_cells()), MemoryBreakdown{});
  for (int r = 0; r < world.size() && r < static_cast<int>(peaks.size()); ++r) {
    const RankCoord c = world.coord(r);
    const MemoryBreakdown& m = peaks[static_cast<std::size_t>(r)];
    report.executed_ranks.push_back({r, c.dp, c.pp, c.tp, c.cp, world.cell(r), m});
    MemoryBreakdown& cell = report.memory[static_cast<std::size_t>(world.cell(r))];
    if (m.total() > cell.total()) cell = m;
  }
  report.allocated_peak_bytes = engine->allocated_peaks();
  report.result = compute_result(plan, report.timeline, report.memory);
  report.result.mfu = 0;  // against the scenario's GPU, not this device: not claimed (calibrate measures it)
  for (const auto& n : rp.notes) report.result.warnings.push_back("runtime: " + n);
  return report;
}

Dataset open_run_data(const RuntimePlan& rp, const RunOptions& options, std::string& source) {
  const auto& rt = rp.plan.config.runtime;
  const int seq = rp.dims.seq_length;
  const auto seed = static_cast<std::uint64_t>(rt.seed);
  if (options.synthetic_data) {
    source = fmt::format("synthetic (order-2 Markov chain over {} tokens, seed {})", rp.dims.vocab_size, seed);
    return Dataset::synthetic(rp.dims.vocab_size, std::size_t{1} << 20, seq, seed);
  }
  const std::string path = options.data_path.empty() ? bundled_corpus_path() : options.data_path;
  source = path;
  return Dataset::from_file(path, seq, seed);
}

Timeline measured_timeline(std::shared_ptr<const Schedule> schedule, const std::vector<RankStep>& ranks) {
  Timeline tl;
  tl.schedule = schedule;
  tl.predicted = false;
  tl.ops.reserve(ranks.size());
  for (const RankStep& r : ranks) tl.ops.push_back(r.timing);
  std::vector<Tick> last_arrival(schedule->collectives.size(), -1);
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const auto& ops = schedule->ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (ops[i].channel >= 0 && is_collective(ops[i].kind))
        last_arrival[ops[i].channel] = std::max(last_arrival[ops[i].channel], ranks[r].arrival[i]);
  }
  // A collective run in parts that each wait for room (ZeRO-3's gathers): part k moves once its
  // last member has room for it, so the time a member spends before that is the pass's pace, not
  // communication, whoever's room it waited for.
  std::vector<std::vector<Tick>> last_room(schedule->collectives.size());
  auto parts_of = [&](std::size_t r, std::size_t i) -> const std::vector<std::pair<Tick, Tick>>& {
    static const std::vector<std::pair<Tick, Tick>> none;
    return i < ranks[r].parts.size() ? ranks[r].parts[i] : none;
  };
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const auto& ops = schedule->ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const auto& parts = parts_of(r, i);
      if (ops[i].channel < 0 || !is_collective(ops[i].kind) || parts.empty()) continue;
      auto& room = last_room[static_cast<std::size_t>(ops[i].channel)];
      room.resize(std::max(room.size(), parts.size()), 0);
      for (std::size_t k = 0; k < parts.size(); ++k) room[k] = std::max(room[k], parts[k].first);
    }
  }
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const auto& ops = schedule->ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (ops[i].channel >= 0 && is_collective(ops[i].kind)) {
        OpTiming& t = tl.ops[r][i];
        t.start = std::min(t.end, std::max(t.start, last_arrival[ops[i].channel]));
        const auto& parts = parts_of(r, i);
        const auto& room = last_room[static_cast<std::size_t>(ops[i].channel)];
        if (!parts.empty() && room.size() == parts.size()) {
          t.waited = 0;
          Tick previous = t.start;  // this member's end of the part before
          for (std::size_t k = 0; k < parts.size(); ++k) {
            t.waited += std::max<Tick>(0, room[k] - previous);
            previous = std::max(previous, parts[k].second);
          }
        }
        t.waited = std::clamp<Tick>(t.waited, 0, t.end - t.start);
      }
  }
  return tl;
}

std::vector<RankStep> cell_steps(const World& world, const std::vector<RankStep>& ranks) {
  if (world.shards_per_cell() == 1) return ranks;
  std::vector<RankStep> cells(static_cast<std::size_t>(world.num_cells()));
  std::vector<bool> seen(cells.size(), false);
  for (int r = 0; r < world.size(); ++r) {
    const RankStep& s = ranks[static_cast<std::size_t>(r)];
    const auto c = static_cast<std::size_t>(world.cell(r));
    if (!seen[c]) {
      cells[c].timing = s.timing;
      cells[c].arrival = s.arrival;
      cells[c].parts = s.parts;
      seen[c] = true;
      continue;
    }
    // Each part of a collective in parts: when the cell's last shard had room, and ended it.
    for (std::size_t i = 0; i < std::min(s.parts.size(), cells[c].parts.size()); ++i) {
      auto& cell = cells[c].parts[i];
      if (cell.size() != s.parts[i].size()) {
        cell.clear();  // shards that disagree: the op's own waits stand
        continue;
      }
      for (std::size_t k = 0; k < cell.size(); ++k) {
        cell[k].first = std::max(cell[k].first, s.parts[i][k].first);
        cell[k].second = std::max(cell[k].second, s.parts[i][k].second);
      }
    }
    for (std::size_t i = 0; i < s.timing.size(); ++i) {
      cells[c].timing[i].start = std::max(cells[c].timing[i].start, s.timing[i].start);
      cells[c].timing[i].end = std::max(cells[c].timing[i].end, s.timing[i].end);
      cells[c].timing[i].waited = std::min(cells[c].timing[i].waited, s.timing[i].waited);  // held up: every shard
      cells[c].arrival[i] = std::max(cells[c].arrival[i], s.arrival[i]);
    }
  }
  return cells;
}

StepRecord step_record(int step, double seconds, const std::vector<RankStep>& ranks, std::string* first_nonfinite) {
  StepRecord rec;
  rec.step = step;
  rec.step_time_s = seconds;
  double loss_sum = 0;
  int loss_count = 0;
  Tick first_bad = -1;
  std::string first_bad_what;
  for (const RankStep& r : ranks) {
    loss_sum += r.loss_sum;
    loss_count += r.loss_count;
    rec.nonfinite_count += r.numerics.nonfinite_count;
    rec.skipped_ranks += r.numerics.skipped ? 1 : 0;
    if (r.first_nonfinite_at >= 0 && (first_bad < 0 || r.first_nonfinite_at < first_bad)) {
      first_bad = r.first_nonfinite_at;
      first_bad_what = r.numerics.first_nonfinite;
    }
    rec.ranks.push_back(r.numerics);
    rec.foreign_seconds = std::max(rec.foreign_seconds, r.foreign_seconds);
  }
  rec.loss = loss_count > 0 ? loss_sum / loss_count : NAN;
  if (!ranks.empty()) {
    rec.grad_norm = ranks[0].grad_norm;
    rec.loss_scale = ranks[0].numerics.loss_scale;
    rec.skipped = ranks[0].numerics.skipped;
  }
  if (first_nonfinite) *first_nonfinite = first_bad_what;
  return rec;
}

std::optional<RunFailure> LossWatch::check(const StepRecord& rec, int first_step,
                                           const std::string& step_first_nonfinite) {
  if (!have_first_ || std::isnan(first_loss_)) {
    first_loss_ = rec.loss;
    have_first_ = true;
  }
  if (first_trouble_.empty() && !step_first_nonfinite.empty())
    first_trouble_ = fmt::format("non-finite values first appeared at step {}, in {}", rec.step, step_first_nonfinite);
  const std::string origin = first_trouble_.empty() ? "" : "; " + first_trouble_;
  if (!std::isfinite(rec.loss))
    return RunFailure{rec.step, fmt::format("loss became {} at step {}{}", std::isnan(rec.loss) ? "NaN" : "infinite",
                                            rec.step, origin)};
  if (rec.step > first_step + 2 && rec.loss > 3 * first_loss_)
    return RunFailure{rec.step, fmt::format("loss diverged at step {}: {:.3f}, more than 3x the first step's {:.3f}{}",
                                            rec.step, rec.loss, first_loss_, origin)};
  return std::nullopt;
}

bool checkpoint_due(const RunOptions& options, int step, int steps) {
  return !options.checkpoint_dir.empty() && options.checkpoint_every_steps > 0 &&
         (step % options.checkpoint_every_steps == 0 || step == steps);
}

std::vector<int> timed_step_indices(const std::vector<StepRecord>& steps) {
  std::vector<int> idx;
  const bool others = std::any_of(steps.begin(), steps.end(), [&](const StepRecord& s) { return s.step != steps[0].step; });
  for (int i = 0; i < static_cast<int>(steps.size()); ++i)
    if (!others || steps[i].step != steps[0].step) idx.push_back(i);
  return idx;
}

std::vector<StepRecord> steps_as_run(const RunReport& report) {
  std::vector<StepRecord> all = report.steps;
  all.insert(all.end(), report.replayed_steps.begin(), report.replayed_steps.end());
  return all;
}

int reported_step_index(const RunReport& report) {
  int i = 0;
  for (const std::vector<StepRecord>* run : {&report.steps, &report.replayed_steps})
    for (const StepRecord& s : *run) {
      if (s.step == report.timeline_step && s.replay == report.timeline_replay) return i;
      ++i;
    }
  return -1;
}

const StepRecord* reported_step(const RunReport& report) {
  const int i = reported_step_index(report);
  if (i < 0) return nullptr;
  const auto at = static_cast<std::size_t>(i);
  return at < report.steps.size() ? &report.steps[at] : &report.replayed_steps[at - report.steps.size()];
}

bool chosen_by_host_share(const std::vector<StepRecord>& steps) {
  const std::vector<int> idx = timed_step_indices(steps);
  return idx.size() >= kLeastDisturbedFrom &&
         std::all_of(idx.begin(), idx.end(), [&](int i) { return steps[i].foreign_seconds >= 0; });
}

int median_step_index(const std::vector<StepRecord>& steps) {
  if (steps.empty()) return -1;
  std::vector<int> idx = timed_step_indices(steps);
  // Where the engine measured what the host took from the ranks' cores: the half it took least from.
  const auto host_share = [&](int i) { return steps[i].foreign_seconds / std::max(1e-12, steps[i].step_time_s); };
  if (chosen_by_host_share(steps)) {
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return host_share(a) < host_share(b); });
    idx.resize((idx.size() + 1) / 2);
  }
  std::sort(idx.begin(), idx.end(), [&](int a, int b) {
    return steps[a].step_time_s < steps[b].step_time_s || (steps[a].step_time_s == steps[b].step_time_s && a < b);
  });
  return idx[idx.size() / 2];
}

}  // namespace trainsim::runtime
