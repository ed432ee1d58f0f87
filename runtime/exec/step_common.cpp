#include "runtime/exec/step_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include <fmt/format.h>

namespace trainsim::runtime {

GradientBuckets gradient_buckets(const Schedule& schedule, int V, const std::vector<std::size_t>& grad_elems) {
  GradientBuckets out;
  out.ranges.assign(V, {});
  out.bucket_of_collective.assign(schedule.collectives.size(), -1);
  std::vector<std::vector<int>> ids(V);
  // Gradient collectives are created per virtual stage in bucket order (see core/schedule.cpp);
  // recover each one's (vstage, bucket) from the programs.
  for (const auto& prog : schedule.ranks)
    for (const Op& op : prog.ops)
      if ((op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter) && op.bucket >= 0) {
        auto& v = ids[op.chunk];
        if (static_cast<int>(v.size()) <= op.bucket) v.resize(op.bucket + 1, -1);
        v[op.bucket] = op.channel;
      }
  for (int vs = 0; vs < V; ++vs) {
    double total = 0;
    for (int id : ids[vs]) total += static_cast<double>(schedule.collectives[id].bytes);
    double cum = 0;
    const auto n = static_cast<double>(grad_elems[vs]);
    for (std::size_t k = 0; k < ids[vs].size(); ++k) {
      const auto lo = static_cast<std::size_t>(std::llround(n * cum / total));
      cum += static_cast<double>(schedule.collectives[ids[vs][k]].bytes);
      const auto hi = k + 1 == ids[vs].size() ? grad_elems[vs] : static_cast<std::size_t>(std::llround(n * cum / total));
      out.ranges[vs].push_back({lo, hi});
      out.bucket_of_collective[ids[vs][k]] = static_cast<int>(k);
    }
  }
  return out;
}

StageSpec stage_spec(const RuntimePlan& rp, int vs) {
  const Plan& plan = rp.plan;
  const int V = plan.num_virtual_stages();
  int first_layer = 0;
  for (int v = 0; v < vs; ++v) first_layer += plan.layers_per_virtual_stage[v];
  StageSpec spec;
  spec.dims = rp.dims;
  spec.first_layer = first_layer;
  spec.num_layers = plan.layers_per_virtual_stage[vs];
  spec.has_embedding = vs == 0;
  spec.has_head = vs == V - 1;
  spec.compute = plan.config.precision.compute;
  spec.grad_accumulation = plan.config.precision.grad_accumulation;
  spec.micro_batch_size = plan.micro_batch_size;
  return spec;
}

OptimizerSettings optimizer_settings(const ScenarioConfig& cfg) {
  OptimizerSettings os;
  os.kind = cfg.training.optimizer;
  os.learning_rate = cfg.training.lr;
  os.beta1 = cfg.training.adam_beta1;
  os.beta2 = cfg.training.adam_beta2;
  os.eps = cfg.training.adam_eps;
  os.weight_decay = cfg.training.weight_decay;
  return os;
}

std::vector<std::vector<int>> reduction_groups(const Schedule& schedule, int world_size) {
  std::vector<std::vector<int>> groups;
  auto add = [&](const std::vector<int>& members) {
    if (std::find(groups.begin(), groups.end(), members) == groups.end()) groups.push_back(members);
  };
  for (const Collective& c : schedule.collectives) add(c.members);
  std::vector<int> everyone(world_size);
  for (int r = 0; r < world_size; ++r) everyone[r] = r;
  add(everyone);
  return groups;
}

InFlight in_flight(const RankProgram& program, int chunk) {
  // Per micro-batch: [forward, backward end] for its stash, [backward begin, backward end] for its
  // backward, as op indices; -1 where it has none.
  struct Span {
    int forward = -1, begin = -1, end = -1;
    bool split = false;
  };
  std::map<int, Span> spans;
  const auto& ops = program.ops;
  for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
    const Op& op = ops[i];
    if (op.chunk != chunk) continue;
    Span& s = spans[op.microbatch];
    switch (op.kind) {
      case OpKind::Forward: s.forward = i; break;
      case OpKind::Backward:
        if (s.begin < 0) s.begin = i;
        s.end = i;  // the last segment ends it
        break;
      case OpKind::BackwardInput:
        s.begin = i;
        s.split = true;
        break;
      case OpKind::BackwardWeight:
        if (op.bucket <= 0) s.end = i;  // the weight pass runs whole in its first segment
        break;
      default: break;
    }
  }
  InFlight most;
  for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
    InFlight now;
    for (const auto& [mb, s] : spans) {
      const auto covers = [&](int from) { return from >= 0 && from <= i && (s.end < 0 || i <= s.end); };
      now.stashes += covers(s.forward) ? 1 : 0;
      if (covers(s.begin)) ++(s.split ? now.split_backwards : now.backwards);
    }
    most.stashes = std::max(most.stashes, now.stashes);
    most.backwards = std::max(most.backwards, now.backwards);
    most.split_backwards = std::max(most.split_backwards, now.split_backwards);
  }
  return most;
}

std::vector<std::pair<int, int>> p2p_links(const Schedule& schedule) {
  std::vector<std::pair<int, int>> links;
  for (int r = 0; r < static_cast<int>(schedule.ranks.size()); ++r)
    for (const Op& op : schedule.ranks[r].ops)
      if (is_send(op.kind)) links.emplace_back(r, op.peer);
  std::sort(links.begin(), links.end());
  links.erase(std::unique(links.begin(), links.end()), links.end());
  return links;
}

Timeline measured_timeline(std::shared_ptr<const Schedule> schedule, const std::vector<std::vector<OpTiming>>& timing,
                           const std::vector<std::vector<Tick>>& arrival) {
  Timeline tl;
  tl.schedule = schedule;
  tl.predicted = false;
  tl.ops = timing;
  const int ranks = static_cast<int>(timing.size());
  std::vector<Tick> last_arrival(schedule->collectives.size(), -1);
  for (int r = 0; r < ranks; ++r) {
    const auto& ops = schedule->ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (ops[i].channel >= 0 && is_collective(ops[i].kind))
        last_arrival[ops[i].channel] = std::max(last_arrival[ops[i].channel], arrival[r][i]);
  }
  for (int r = 0; r < ranks; ++r) {
    const auto& ops = schedule->ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (ops[i].channel >= 0 && is_collective(ops[i].kind))
        tl.ops[r][i].start = std::min(tl.ops[r][i].end, std::max(tl.ops[r][i].start, last_arrival[ops[i].channel]));
  }
  return tl;
}

std::string error_text(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

bool checkpoint_due(const RunOptions& options, int step, int steps) {
  return !options.checkpoint_dir.empty() && options.checkpoint_every_steps > 0 &&
         (step % options.checkpoint_every_steps == 0 || step == steps);
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

std::uint64_t fnv1a(std::uint64_t h, std::span<const float> xs) {
  for (float x : xs) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    for (int b = 0; b < 4; ++b) {
      h ^= (u >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return h;
}

double weight_difference(std::span<const float> a, std::span<const float> b) {
  double drift = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    std::uint32_t ua, ub;
    std::memcpy(&ua, &a[i], 4);
    std::memcpy(&ub, &b[i], 4);
    if (ua == ub) continue;
    const double diff = std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    drift = std::max(drift, std::isnan(diff) ? INFINITY : diff);
  }
  return drift;
}

int median_step_index(const std::vector<StepRecord>& steps) {
  if (steps.empty()) return -1;
  std::vector<int> idx;
  for (int i = steps.size() > 1 ? 1 : 0; i < static_cast<int>(steps.size()); ++i) idx.push_back(i);
  std::sort(idx.begin(), idx.end(), [&](int a, int b) {
    return steps[a].step_time_s < steps[b].step_time_s || (steps[a].step_time_s == steps[b].step_time_s && a < b);
  });
  return idx[idx.size() / 2];
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

}  // namespace trainsim::runtime
