// Plan -> prediction: builds the schedule, prices it with the default cost models, runs
// the discrete-event engine, walks memory and computes the result fields.
#pragma once

#include <memory>
#include <vector>

#include "core/plan.h"
#include "core/result.h"
#include "core/schedule.h"
#include "core/timeline.h"

namespace trainsim {

class MemoryModel;
struct ResultIndex;
struct StepFigures;

struct Prediction {
  std::shared_ptr<const Schedule> schedule;
  Timeline timeline;
  std::vector<MemoryBreakdown> memory;  // per rank, at its peak
  Result result;
};

// The reference path (what `trainsim simulate` runs): fresh buffers, every rank simulated.
Prediction predict(const Plan& plan);

// `config` with every field cleared that only the cost models, the memory model or the
// runtime read, into `key` (its storage reused): two configurations with equal keys have
// the same schedule (build_schedule), which is what Predictor::evaluate's cache relies on.
// Every other field is compared (operator==, so a new field is too), and
// tests/test_step_program.cpp changes each cleared field on random plans and checks that
// the schedule stays the same.
void schedule_key_into(const ScenarioConfig& config, ScenarioConfig& key);

// Predicts plan after plan on one thread, reusing its buffers between calls: what a sweep
// worker keeps (one per thread; no state is shared between Predictors). Gives exactly what
// predict() gives (tests/test_engine.cpp compares them on random plans), faster:
//  * the schedule, engine state, Timeline and Result are rebuilt in place;
//  * replicas 1.. of the schedule are derived from replica 0's programs;
//  * when every data-parallel replica's messages cross the same kind of link and its
//    per-replica collectives cost the same, only replica 0 is simulated and the other
//    replicas take its timings, memory and per-rank figures (the full discrete-event
//    simulation of one replica; collectives shared between replicas start when replica 0's
//    members have arrived, as every replica arrives at the same time).
class Predictor {
 public:
  Predictor();
  ~Predictor();
  Predictor(const Predictor&) = delete;
  Predictor& operator=(const Predictor&) = delete;

  // The prediction for `plan`; valid until the next call on this Predictor.
  const Prediction& predict(const Plan& plan);

  // predict(plan).result alone, every field, rank and warning the same (tests/test_engine.cpp
  // and tests/test_step_program.cpp compare them whole on random plans), for callers that
  // read nothing else (sweeps). When the replicas are symmetric, the programs and timings of
  // replicas 1.. are never built: only replica 0's schedule is, and the other ranks' result
  // entries are their stage's entries in replica 0 with rank and replica set.
  // Schedules are cached across calls (the last 8, up to a million ops), keyed on
  // schedule_key_into: a configuration that differs from an earlier one only in what prices
  // its ops (rates, links, memory, recompute, ...) reuses its schedule. The first
  // configuration of a schedule runs the engine on it, the second compiles it into a
  // StepProgram (sim/step_program.h), and every later one re-prices and evaluates that
  // program, which gives the engine's Timeline op for op. Valid until the next call on this
  // Predictor; invalidates the Prediction of an earlier predict().
  const Result& evaluate(const Plan& plan);

  // evaluate() of n plans (0 <= n <= kMaxBatch) at once: *out[j] is evaluate(*plans[j]), in
  // order, valid until the next call on this Predictor. Consecutive plans of one compiled
  // schedule are stepped together (StepProgram::run_lanes_figures), the way a sweep meets
  // them: its variants of prices one after the other.
  static constexpr int kMaxBatch = 4;
  void evaluate_batch(const Plan* const* plans, int n, const Result** out);

 private:
  struct Route;
  struct Models;
  Route route(const Plan& plan, const Models& models, Result& out);
  void finish_route(const Plan& plan, const Route& route, const StepFigures* figures, Result& out);
  void finish(const Plan& plan, const MemoryModel& memory, const Schedule& schedule, bool symmetric, Result& out,
              const std::vector<RankProgram>* memory_walk = nullptr, const std::vector<double>* stage_peaks = nullptr,
              const ResultIndex* index = nullptr, const StepFigures* figures = nullptr);

  struct Workspace;
  std::unique_ptr<Workspace> ws_;
  std::shared_ptr<Schedule> schedule_;
  Prediction last_;
};

}  // namespace trainsim
