// Chrome Trace Event Format (the JSON object form), as Perfetto and chrome://tracing read it:
// https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
//
// Events are written one per line as they are produced rather than built into one JSON
// document first: a big schedule has hundreds of thousands of events.
#include <ostream>
#include <string>

#include <fmt/format.h>

#include "core/report/report.h"

namespace trainsim {

namespace {

using ojson = nlohmann::ordered_json;

// Ticks are picoseconds, trace timestamps microseconds. Kept fractional: a 300 ns send is
// 0.3, not 0. Tick counts below 2^53 (2.5 hours) are exact in a double, and nlohmann
// writes the shortest decimal that reads back as the same double.
double ticks_to_us(Tick t) { return static_cast<double>(t) / 1e6; }

const char* stream_name(StreamKind s) {
  switch (s) {
    case StreamKind::compute: return "compute";
    case StreamKind::collective: return "collective";
    case StreamKind::p2p: return "p2p";
  }
  return "?";
}

ojson metadata(const char* name, int pid, int tid, ojson args) {
  ojson e;
  e["name"] = name;
  e["ph"] = "M";
  e["pid"] = pid;
  e["tid"] = tid;
  e["args"] = std::move(args);
  return e;
}

// The facts about an op that a person looks for when clicking on it; -1 fields are absent.
ojson op_args(const Plan& plan, const RankProgram& prog, const Op& op) {
  ojson a;
  a["stage"] = prog.stage;
  a["replica"] = prog.replica;
  if (op.chunk >= 0) {
    a["chunk"] = op.chunk;  // virtual stage, 0..p*v-1
    if (plan.vpp > 1) a["local_chunk"] = op.chunk / plan.pp;
  }
  if (op.microbatch >= 0) a["microbatch"] = op.microbatch;
  if (op.bucket >= 0) a["bucket"] = op.bucket;
  if (op.bytes > 0) a["bytes"] = op.bytes;
  if (op.peer >= 0) a["peer"] = op.peer;
  if (op.work < 1.0) a["work"] = op.work;  // a backward split at gradient-bucket bounds
  return a;
}

}  // namespace

namespace {

// The events of one timeline: ranks as processes pid_base + rank, named with `label` when given.
template <class Emit>
void emit_timeline(const Plan& plan, const Timeline& timeline, const std::string& label, int pid_base, Emit&& emit) {
  const Schedule& s = *timeline.schedule;
  // Timestamps count from the step's first op, so predicted and measured traces line up.
  const Tick t0 = timeline.begin();
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    const RankProgram& prog = s.ranks[r];
    const auto& times = timeline.ops.at(r);
    const int pid = pid_base + prog.rank;
    emit(metadata("process_name", pid, 0,
                  {{"name", fmt::format("{}rank {} (stage {}, replica {})", label.empty() ? "" : label + " ",
                                        prog.rank, prog.stage, prog.replica)}}));
    emit(metadata("process_sort_index", pid, 0, {{"sort_index", pid}}));

    // Name only the streams this rank uses, so Perfetto shows no empty tracks.
    bool used[kNumStreams] = {};
    for (const Op& op : prog.ops) used[static_cast<int>(stream_of(op.kind))] = true;
    for (int st = 0; st < kNumStreams; ++st) {
      if (!used[st]) continue;
      emit(metadata("thread_name", pid, st, {{"name", stream_name(static_cast<StreamKind>(st))}}));
      emit(metadata("thread_sort_index", pid, st, {{"sort_index", st}}));
    }

    for (std::size_t i = 0; i < prog.ops.size(); ++i) {
      const Op& op = prog.ops[i];
      const OpTiming& t = times.at(i);
      // A receive takes no time of its own; it is shown only where it kept the compute
      // stream waiting for its message.
      const bool recv = is_recv(op.kind);
      if (recv && t.end <= t.start) continue;
      ojson e;
      e["name"] = recv ? "wait " + op_label(op) : op_label(op);
      e["cat"] = op_kind_name(op.kind);
      e["ph"] = "X";
      e["pid"] = pid;
      e["tid"] = static_cast<int>(stream_of(op.kind));
      e["ts"] = ticks_to_us(t.start - t0);
      e["dur"] = ticks_to_us(t.end - t.start);
      e["args"] = op_args(plan, prog, op);
      // Held up rather than working (a turn at a shared core, ZeRO-3's waits between units).
      if (t.waited > 0) e["args"]["waited_us"] = ticks_to_us(t.waited);
      emit(e);
    }
  }
}

ojson plan_facts(const Plan& plan, const Schedule& s, const char* timeline_kind) {
  ojson other;
  other["scenario"] = plan.config.name;
  if (!plan.source.empty()) other["source"] = plan.source;
  other["schedule"] = std::string(schedule_name(s.kind));
  if (timeline_kind) other["timeline"] = timeline_kind;
  other["data_parallel_size"] = plan.dp;
  other["pipeline_parallel_size"] = plan.pp;
  other["tensor_parallel_size"] = plan.tp;
  other["context_parallel_size"] = plan.cp;
  other["virtual_pipeline_stages"] = plan.vpp;
  other["num_microbatches"] = plan.num_microbatches;
  return other;
}

}  // namespace

void write_chrome_trace(const Plan& plan, const Timeline& timeline, std::ostream& out) {
  out << "{\"traceEvents\":[\n";
  bool first = true;
  emit_timeline(plan, timeline, "", 0, [&](const ojson& e) {
    out << (first ? "" : ",\n") << e.dump();
    first = false;
  });
  out << "\n],\n";
  ojson other = plan_facts(plan, *timeline.schedule, timeline.predicted ? "predicted" : "measured");
  other["step_time_s"] = ticks_to_seconds(timeline.end() - timeline.begin());
  out << "\"displayTimeUnit\":\"ms\",\n\"otherData\":" << other.dump() << "\n}\n";
}

void write_chrome_traces(const Plan& plan, const std::vector<std::pair<std::string, const Timeline*>>& timelines,
                         std::ostream& out) {
  out << "{\"traceEvents\":[\n";
  bool first = true;
  for (std::size_t k = 0; k < timelines.size(); ++k)
    emit_timeline(plan, *timelines[k].second, timelines[k].first, static_cast<int>(k) * 1000, [&](const ojson& e) {
      out << (first ? "" : ",\n") << e.dump();
      first = false;
    });
  out << "\n],\n";
  ojson other = timelines.empty() ? ojson::object() : plan_facts(plan, *timelines.front().second->schedule, nullptr);
  for (const auto& [label, t] : timelines) other[label + "_step_time_s"] = ticks_to_seconds(t->end() - t->begin());
  out << "\"displayTimeUnit\":\"ms\",\n\"otherData\":" << other.dump() << "\n}\n";
}

}  // namespace trainsim
