// Reports: the Chrome trace, the SVG timeline and the result JSON. Every expectation is
// computed from the schedule, timeline or result the report was written from, never
// copied from a previous run's output.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/plan.h"
#include "core/config_fields.h"
#include "tests/test_helpers.h"
#include "core/report/format.h"
#include "core/report/report.h"
#include "sim/simulator.h"

namespace trainsim {
namespace {

using json = nlohmann::json;

// A small model that divides into 8 virtual stages, on dp x pp GPUs with m micro-batches.
ScenarioConfig small_config(ScheduleKind kind, int dp, int pp, int m, int vpp = 1) {
  ScenarioConfig c;
  c.name = "report-test";
  c.model.num_layers = 8;
  c.model.hidden_size = 1024;
  c.model.num_attention_heads = 16;
  c.model.seq_length = 1024;
  c.cluster.num_gpus = dp * pp;
  c.cluster.gpus_per_node = std::min(8, dp * pp);
  c.parallelism.data_parallel_size = dp;
  c.parallelism.pipeline_parallel_size = pp;
  c.parallelism.virtual_pipeline_stages = vpp;
  c.parallelism.schedule = kind;
  c.training.micro_batch_size = 1;
  c.training.global_batch_size = m * dp;
  return c;
}

std::string trace_of(const Plan& plan, const Prediction& p) {
  std::ostringstream o;
  write_chrome_trace(plan, p.timeline, o);
  return o.str();
}

std::string svg_of(const Plan& plan, const Prediction& p) {
  std::ostringstream o;
  write_timeline_svg(plan, p.timeline, p.result, o);
  return o.str();
}

double to_us(Tick t) { return static_cast<double>(t) / 1e6; }

void expect_close(double got, double want, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), 1e-6 * std::max(1.0, std::fabs(want))) << what << ": " << got << " vs " << want;
}

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + needle.size())) ++n;
  return n;
}

// Tags nest and close in order; returns "" or the first problem. Enough XML to catch an
// unclosed group, a stray '<' from unescaped text, or a misspelled closing tag.
std::string check_tags(const std::string& doc) {
  std::vector<std::string> open;
  for (std::size_t i = doc.find('<'); i != std::string::npos; i = doc.find('<', i + 1)) {
    const std::size_t close = doc.find('>', i);
    if (close == std::string::npos) return fmt::format("unterminated tag at {}", i);
    const std::string tag = doc.substr(i + 1, close - i - 1);
    if (tag.empty() || tag.find('<') != std::string::npos) return fmt::format("stray '<' at {}", i);
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1))
        return fmt::format("</{}> at {} closes <{}>", tag.substr(1), i, open.empty() ? "" : open.back());
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
    i = close;
  }
  return open.empty() ? "" : fmt::format("<{}> never closed", open.back());
}

// A schedule of each kind, with data parallelism so that every stream carries ops.
struct Case {
  const char* name;
  ScenarioConfig config;
};
std::vector<Case> schedule_cases() {
  ScenarioConfig overlapped = small_config(ScheduleKind::one_f_one_b, 2, 4, 8);
  overlapped.communication.overlap_grad_reduce = true;
  overlapped.communication.bucket_size_mib = 8;  // several buckets, so the last backward is split
  ScenarioConfig zero = small_config(ScheduleKind::gpipe, 2, 2, 4);
  zero.parallelism.zero_stage = 1;
  return {
      {"gpipe", small_config(ScheduleKind::gpipe, 2, 4, 8)},
      {"1f1b", small_config(ScheduleKind::one_f_one_b, 2, 4, 8)},
      {"interleaved", small_config(ScheduleKind::interleaved_1f1b, 2, 4, 8, 2)},
      {"zb-h1", small_config(ScheduleKind::zb_h1, 2, 4, 8)},
      {"1f1b-overlap", overlapped},
      {"gpipe-zero1", zero},
  };
}

// ---- Chrome trace ---------------------------------------------------------------------

TEST(ChromeTrace, OneCompleteEventPerOpWithTheTimelinesTimes) {
  for (const auto& [name, config] : schedule_cases()) {
    SCOPED_TRACE(name);
    const Plan plan = Plan::from_config(config);
    const Prediction p = predict(plan);
    const json trace = json::parse(trace_of(plan, p));
    const Schedule& s = *p.schedule;
    const Tick t0 = p.timeline.begin();

    // Complete events grouped by process, in the order written.
    std::map<int, std::vector<json>> events;
    for (const auto& e : trace.at("traceEvents"))
      if (e.at("ph") == "X") events[e.at("pid").get<int>()].push_back(e);

    std::set<int> pids;
    for (const auto& [pid, v] : events) pids.insert(pid);
    std::set<int> ranks;
    for (const auto& prog : s.ranks) ranks.insert(prog.rank);
    EXPECT_EQ(pids, ranks);

    for (std::size_t r = 0; r < s.ranks.size(); ++r) {
      const RankProgram& prog = s.ranks[r];
      // Every op but a receive that did not wait, in program order.
      std::vector<std::size_t> expected;
      for (std::size_t i = 0; i < prog.ops.size(); ++i) {
        const OpTiming& t = p.timeline.ops[r][i];
        if (!is_recv(prog.ops[i].kind) || t.end > t.start) expected.push_back(i);
      }
      const auto& got = events[prog.rank];
      ASSERT_EQ(got.size(), expected.size()) << "rank " << prog.rank;
      for (std::size_t k = 0; k < got.size(); ++k) {
        const Op& op = prog.ops[expected[k]];
        const OpTiming& t = p.timeline.ops[r][expected[k]];
        const json& e = got[k];
        const std::string label = is_recv(op.kind) ? "wait " + op_label(op) : op_label(op);
        EXPECT_EQ(e.at("name"), label);
        EXPECT_EQ(e.at("cat"), op_kind_name(op.kind));
        EXPECT_EQ(e.at("tid").get<int>(), static_cast<int>(stream_of(op.kind)));
        expect_close(e.at("ts").get<double>(), to_us(t.start - t0), label + " ts");
        expect_close(e.at("dur").get<double>(), to_us(t.end - t.start), label + " dur");
        const json& args = e.at("args");
        EXPECT_EQ(args.at("stage").get<int>(), prog.stage);
        EXPECT_EQ(args.at("replica").get<int>(), prog.replica);
        if (op.microbatch >= 0) {
          EXPECT_EQ(args.at("microbatch").get<int>(), op.microbatch);
        }
        if (op.chunk >= 0) {
          EXPECT_EQ(args.at("chunk").get<int>(), op.chunk);
        }
        if (op.bucket >= 0) {
          EXPECT_EQ(args.at("bucket").get<int>(), op.bucket);
        }
        if (op.bytes > 0) {
          EXPECT_EQ(args.at("bytes").get<Bytes>(), op.bytes);
        }
      }
    }
  }
}

TEST(ChromeTrace, NamesEveryRankAndStream) {
  const Plan plan = Plan::from_config(small_config(ScheduleKind::one_f_one_b, 2, 4, 8));
  const Prediction p = predict(plan);
  const json trace = json::parse(trace_of(plan, p));
  const Schedule& s = *p.schedule;

  std::map<int, std::string> process_names;
  std::map<int, int> sort_index;
  std::map<std::pair<int, int>, std::string> thread_names;
  std::set<int> tids;
  for (const auto& e : trace.at("traceEvents")) {
    const int pid = e.at("pid").get<int>();
    const int tid = e.at("tid").get<int>();
    tids.insert(tid);
    if (e.at("ph") != "M") continue;
    if (e.at("name") == "process_name") {
      EXPECT_TRUE(process_names.emplace(pid, e.at("args").at("name")).second) << "pid " << pid << " named twice";
    } else if (e.at("name") == "process_sort_index") {
      sort_index[pid] = e.at("args").at("sort_index").get<int>();
    } else if (e.at("name") == "thread_name") {
      thread_names[{pid, tid}] = e.at("args").at("name");
    }
  }
  // Every rank of this schedule computes, sends to a neighbour stage and all-reduces.
  EXPECT_EQ(tids, (std::set<int>{0, 1, 2}));
  ASSERT_EQ(process_names.size(), s.ranks.size());
  for (const auto& prog : s.ranks) {
    EXPECT_EQ(process_names[prog.rank], fmt::format("rank {} (stage {}, replica {})", prog.rank, prog.stage, prog.replica));
    EXPECT_EQ(sort_index[prog.rank], prog.rank);
    EXPECT_EQ((thread_names[{prog.rank, 0}]), "compute");
    EXPECT_EQ((thread_names[{prog.rank, 1}]), "collective");
    EXPECT_EQ((thread_names[{prog.rank, 2}]), "p2p");
  }
}

TEST(ChromeTrace, OtherDataNamesTheRun) {
  const Plan plan = Plan::from_config(small_config(ScheduleKind::zb_h1, 1, 4, 8));
  Prediction p = predict(plan);
  json trace = json::parse(trace_of(plan, p));
  EXPECT_EQ(trace.at("displayTimeUnit"), "ms");
  EXPECT_EQ(trace.at("otherData").at("scenario"), plan.config.name);
  EXPECT_EQ(trace.at("otherData").at("schedule"), std::string(schedule_name(ScheduleKind::zb_h1)));
  EXPECT_EQ(trace.at("otherData").at("timeline"), "predicted");

  p.timeline.predicted = false;
  trace = json::parse(trace_of(plan, p));
  EXPECT_EQ(trace.at("otherData").at("timeline"), "measured");
}

// A timeline written by hand: ops far shorter than a microsecond keep their length, and a
// receive is shown only when it waited.
TEST(ChromeTrace, SubMicrosecondOpsStayFractional) {
  const Plan plan = Plan::from_config(small_config(ScheduleKind::one_f_one_b, 1, 1, 1));
  auto s = std::make_shared<Schedule>();
  s->ranks.resize(1);
  const auto add = [&](OpKind kind, int mb) {
    Op op;
    op.kind = kind;
    op.microbatch = mb;
    s->ranks[0].ops.push_back(op);
  };
  add(OpKind::RecvActivation, 0);  // message already there: no wait
  add(OpKind::Forward, 0);
  add(OpKind::SendActivation, 0);
  add(OpKind::RecvGradient, 0);  // waits
  add(OpKind::OptimizerStep, -1);
  Timeline tl;
  tl.schedule = s;
  tl.ops = {{{0, 0}, {0, 300'000, 100'000}, {300'000, 300'001}, {300'000, 1'234'567'891}, {1'234'567'891, 1'234'567'892}}};

  std::ostringstream o;
  write_chrome_trace(plan, tl, o);
  const json trace = json::parse(o.str());
  std::map<std::string, json> by_name;
  for (const auto& e : trace.at("traceEvents"))
    if (e.at("ph") == "X") by_name[e.at("name")] = e;
  ASSERT_EQ(by_name.size(), 4u);
  EXPECT_EQ(by_name.count("wait recv act 0"), 0u);
  EXPECT_DOUBLE_EQ(by_name.at("F0").at("dur").get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(by_name.at("send act 0").at("dur").get<double>(), 1e-6);  // one picosecond
  EXPECT_DOUBLE_EQ(by_name.at("wait recv grad 0").at("dur").get<double>(), (1'234'567'891 - 300'000) / 1e6);
  EXPECT_DOUBLE_EQ(by_name.at("optimizer").at("ts").get<double>(), 1234.567891);
  // The forward was held up 0.1 us of its 0.3 (a turn at a shared core): said, and only there.
  EXPECT_DOUBLE_EQ(by_name.at("F0").at("args").at("waited_us").get<double>(), 0.1);
  EXPECT_FALSE(by_name.at("optimizer").at("args").contains("waited_us"));
}

// ---- SVG ------------------------------------------------------------------------------

TEST(TimelineSvg, IsWellFormedWithOneLabelPerRankAndALegend) {
  const Plan plan = Plan::from_config(small_config(ScheduleKind::one_f_one_b, 2, 4, 8));
  const Prediction p = predict(plan);
  const std::string svg = svg_of(plan, p);

  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  ASSERT_GE(svg.size(), 7u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(check_tags(svg), "");
  EXPECT_EQ(count_of(svg, "<g"), count_of(svg, "</g>"));
  EXPECT_NE(svg.find("<title>trainsim timeline: report-test"), std::string::npos);

  for (const auto& r : p.result.ranks) {
    const std::string label = fmt::format(">rank {}  s {} / d {}  util {:.0f}%<", r.rank, r.stage, r.replica,
                                          100 * r.utilization);
    EXPECT_EQ(count_of(svg, label), 1u) << label;
  }
  for (const char* entry : {">compute<", ">communication<", ">forward<", ">backward<", ">optimizer step<",
                            ">idle or waiting<", ">all-reduce<", ">send activation<", ">send gradient<"})
    EXPECT_NE(svg.find(entry), std::string::npos) << entry;
  // The title line states the step time and bubble of the result.
  EXPECT_NE(svg.find(fmt::format("bubble {:.1f}%", 100 * p.result.bubble_fraction)), std::string::npos);
}

TEST(TimelineSvg, SplitBackwardsAndChunksAreDistinguishable) {
  {
    const Plan plan = Plan::from_config(small_config(ScheduleKind::zb_h1, 1, 4, 8));
    const std::string svg = svg_of(plan, predict(plan));
    EXPECT_NE(svg.find(">backward (input)<"), std::string::npos);
    EXPECT_NE(svg.find(">backward (weight)<"), std::string::npos);
    EXPECT_EQ(svg.find(">backward<"), std::string::npos);  // no unsplit backward in ZB-H1
    EXPECT_NE(svg.find("class=\"bi\""), std::string::npos);
    EXPECT_NE(svg.find("class=\"bw\""), std::string::npos);
  }
  {
    const Plan plan = Plan::from_config(small_config(ScheduleKind::interleaved_1f1b, 1, 4, 8, 2));
    const std::string svg = svg_of(plan, predict(plan));
    EXPECT_EQ(check_tags(svg), "");
    // Chunk 0 and chunk 1 of each rank are drawn in different shades.
    EXPECT_NE(svg.find("<rect class=\"f0\""), std::string::npos);
    EXPECT_NE(svg.find("<rect class=\"f1\""), std::string::npos);
    EXPECT_NE(svg.find("<rect class=\"b1\""), std::string::npos);
  }
}

TEST(TimelineSvg, WideBoxesCarryTheirMicrobatch) {
  // Two stages, two micro-batches: every compute op spans a good part of the picture.
  const Plan plan = Plan::from_config(small_config(ScheduleKind::one_f_one_b, 1, 2, 2));
  const Prediction p = predict(plan);
  const std::string svg = svg_of(plan, p);
  for (const Op& op : p.schedule->ranks[0].ops) {
    if (op.kind == OpKind::Forward || op.kind == OpKind::Backward) {
      EXPECT_NE(svg.find(">" + op_label(op) + "</text>"), std::string::npos) << op_label(op);
      // A picture this small also has hover text on every box.
      EXPECT_NE(svg.find("<title>rank 0: " + op_label(op) + " |"), std::string::npos) << op_label(op);
    }
  }
}

TEST(TimelineSvg, TimeAxisHasRoundTicksWithinTheStep) {
  for (const auto& [name, config] : schedule_cases()) {
    SCOPED_TRACE(name);
    const Plan plan = Plan::from_config(config);
    const Prediction p = predict(plan);
    const std::string svg = svg_of(plan, p);
    const double step = p.result.step_time_s;
    const std::string unit = step >= 1 ? "s" : step >= 1e-3 ? "ms" : "us";
    const double unit_s = unit == "s" ? 1 : unit == "ms" ? 1e-3 : 1e-6;

    // Each tick label is written twice, above and below the rows.
    const std::regex tick("class=\"ax\"[^>]*>([0-9.]+) ([mu]?s)<");
    std::vector<double> ticks;
    for (std::sregex_iterator it(svg.begin(), svg.end(), tick), end; it != end; ++it) {
      EXPECT_EQ((*it)[2].str(), unit);
      ticks.push_back(std::stod((*it)[1].str()));
    }
    ASSERT_EQ(ticks.size() % 2, 0u);
    std::vector<double> upper;
    for (std::size_t i = 0; i < ticks.size(); i += 2) upper.push_back(ticks[i]);
    ASSERT_GE(upper.size(), 4u);
    EXPECT_LE(upper.size(), 21u);
    EXPECT_EQ(upper[0], 0.0);
    const double spacing = upper[1] - upper[0];
    const double mantissa = spacing / std::pow(10.0, std::floor(std::log10(spacing) + 1e-9));
    EXPECT_TRUE(std::fabs(mantissa - 1) < 1e-6 || std::fabs(mantissa - 2) < 1e-6 || std::fabs(mantissa - 5) < 1e-6)
        << "tick spacing " << spacing;
    for (std::size_t i = 1; i < upper.size(); ++i) expect_close(upper[i] - upper[i - 1], spacing, "tick spacing");
    EXPECT_LE(upper.back() * unit_s, step * (1 + 1e-6));
    EXPECT_GT((upper.back() + spacing) * unit_s, step);  // no round tick left out at the end
  }
}

TEST(TimelineSvg, ScenarioNameIsEscaped) {
  ScenarioConfig c = small_config(ScheduleKind::gpipe, 1, 2, 2);
  c.name = "a<&>\"b";
  const Plan plan = Plan::from_config(c);
  const Prediction p = predict(plan);
  const std::string svg = svg_of(plan, p);
  EXPECT_EQ(svg.find("a<&>"), std::string::npos);
  EXPECT_NE(svg.find("a&lt;&amp;&gt;&quot;b"), std::string::npos);
  EXPECT_EQ(check_tags(svg), "");
  // The trace's JSON carries the name as it is.
  EXPECT_EQ(json::parse(trace_of(plan, p)).at("otherData").at("scenario"), c.name);
}

// Many ranks: the replicas of a stage run the same program, so each stage shows its first and
// last replica, and the picture says how many ranks it leaves out.
TEST(TimelineSvg, SamplesReplicasOfLargePlansAndSaysSo) {
  ScenarioConfig c = small_config(ScheduleKind::one_f_one_b, 80, 2, 2);
  const Plan plan = Plan::from_config(c);
  const Prediction p = predict(plan);
  ASSERT_EQ(p.schedule->ranks.size(), 160u);
  const std::string svg = svg_of(plan, p);
  const std::regex row(">rank ([0-9]+)  s ([0-9]+) / d ([0-9]+) ");
  std::set<std::pair<int, int>> drawn;  // (stage, replica)
  for (std::sregex_iterator it(svg.begin(), svg.end(), row), end; it != end; ++it)
    drawn.emplace(std::stoi((*it)[2]), std::stoi((*it)[3]));
  EXPECT_EQ(drawn, (std::set<std::pair<int, int>>{{0, 0}, {0, 79}, {1, 0}, {1, 79}}));
  EXPECT_NE(svg.find("showing 4 of 160 ranks: replicas 0 and 79 of every stage (2)"), std::string::npos);
  EXPECT_NE(svg.find("156 more ranks not drawn"), std::string::npos);
  EXPECT_EQ(check_tags(svg), "");
  // Up to 32 ranks, every rank keeps its row.
  const Plan small = Plan::from_config(small_config(ScheduleKind::one_f_one_b, 8, 4, 8));
  const std::string all = svg_of(small, predict(small));
  for (int r = 0; r < 32; ++r) EXPECT_NE(all.find(fmt::format(">rank {}  s ", r)), std::string::npos) << r;
}

// Llama 2 70B on 64 GPUs, interleaved over 8 stages x 5 chunks with 64 micro-batches: the
// picture stays a readable size (it was 2.6 MB of stripes): one row per stage's first and last
// replica, and repeated forwards and backwards of alternating chunks grouped into bands.
TEST(TimelineSvg, InterleavedSeventyBillionOnSixtyFourGpusStaysReadable) {
  ScenarioConfig c;
  find_field("model.preset")->set(c, std::string("llama2-70b"));
  find_field("cluster.gpu")->set(c, std::string("h100-80gb"));
  c.cluster.num_gpus = 64;
  c.parallelism.data_parallel_size = 8;
  c.parallelism.pipeline_parallel_size = 8;
  c.parallelism.schedule = ScheduleKind::interleaved_1f1b;
  c.parallelism.virtual_pipeline_stages = 5;
  c.training.global_batch_size = 512;
  c.communication.overlap_grad_reduce = true;
  const Plan plan = Plan::from_config(c);
  const Prediction p = predict(plan);
  const std::string svg = svg_of(plan, p);
  EXPECT_EQ(check_tags(svg), "");
  EXPECT_EQ(count_of(svg, "<g id=\"rank"), 16u);
  EXPECT_LT(svg.size(), 400u * 1024u) << "bytes";
  EXPECT_GT(count_of(svg, "ops, F"), 0u) << "repeated forwards are grouped, with their count in the hover text";
}

TEST(TimelineSvg, BigScheduleStaysSmall) {
  // 64 ranks with about 1500 ops each: far more boxes than pixels.
  const Plan plan = Plan::from_config(small_config(ScheduleKind::one_f_one_b, 8, 8, 256));
  const Prediction p = predict(plan);
  const std::size_t ops = p.schedule->total_ops();
  ASSERT_GT(ops, 64u * 1000u);
  const std::string svg = svg_of(plan, p);
  EXPECT_EQ(check_tags(svg), "");
  // No hover text or labels for single boxes too many or too narrow to read: besides the
  // document's <title>, only the grouped bands say what they hold; and the file stays under
  // one short <rect> per op.
  EXPECT_EQ(count_of(svg, "<title>") - 1, count_of(svg, " ops, "));
  EXPECT_LT(svg.size(), ops * 80);
}

// ---- the figures an expert asks for ----------------------------------------------------

// Per GPU: tokens/s, model and hardware TFLOP/s against the published closed forms for a GPT
// (ffn = 4h): model FLOPs per sample 72 s l h^2 (1 + s/(6h) + V/(12 l h)) (Korthikanti et al.
// 2022), hardware FLOPs with full recompute 96 s l h^2 (1 + s/(6h) + V/(16 l h)) (Narayanan et
// al. 2021, eq. 3); time to train, GPU-hours and cost from total_tokens and the price.
TEST(Figures, PerGpuThroughputAndTheWholeRun) {
  ScenarioConfig c = small_config(ScheduleKind::one_f_one_b, 2, 2, 4);
  c.training.activation_recompute = Recompute::full;
  c.training.total_tokens = 1e9;
  c.cluster.price_per_gpu_hour = 2.5;
  const Plan plan = Plan::from_config(c);
  const Result r = predict(plan).result;
  const double s = c.model.seq_length, l = c.model.num_layers, h = c.model.hidden_size, V = c.model.vocab_size;
  const double B = plan.global_batch_size, n = c.cluster.num_gpus, T = r.step_time_s;
  const double model = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
  const double hardware = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  EXPECT_NEAR(r.model_tflops_per_gpu, model / T / n / 1e12, 1e-9 * r.model_tflops_per_gpu);
  EXPECT_NEAR(r.hardware_tflops_per_gpu, hardware / T / n / 1e12, 1e-9 * r.hardware_tflops_per_gpu);
  EXPECT_NEAR(r.model_tflops_per_gpu, r.mfu * plan.peak_flops(c.precision.compute) / 1e12, 1e-9 * r.model_tflops_per_gpu);
  EXPECT_NEAR(r.tokens_per_s_per_gpu * n, r.tokens_per_s, 1e-9 * r.tokens_per_s);
  EXPECT_NEAR(r.time_to_train_s, 1e9 / r.tokens_per_s, 1e-9 * r.time_to_train_s);
  EXPECT_NEAR(r.gpu_hours, r.time_to_train_s * n / 3600, 1e-9 * r.gpu_hours);
  EXPECT_NEAR(r.cost, r.gpu_hours * 2.5, 1e-9 * r.cost);
  const json j = json::parse(result_to_json(r).dump());
  for (const char* k : {"tokens_per_s_per_gpu", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "time_to_train_s",
                        "gpu_hours", "cost", "pipeline_bubble_fraction", "exposed_comm_fraction", "framework",
                        "framework_setting"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_NE(format_summary(plan, r).find("GPU-hours"), std::string::npos);
  // Steps instead of tokens; no price: no cost (null in JSON).
  c.training.total_tokens = 0;
  c.training.train_steps = 1000;
  c.cluster.price_per_gpu_hour = 0;
  const Result by_steps = predict(Plan::from_config(c)).result;
  EXPECT_NEAR(by_steps.time_to_train_s, 1000 * by_steps.step_time_s, 1e-9 * by_steps.time_to_train_s);
  EXPECT_LT(by_steps.cost, 0);
  EXPECT_TRUE(json::parse(result_to_json(by_steps).dump())["cost"].is_null());
  // Without recompute the hardware does what the model needs.
  c.training.activation_recompute = Recompute::none;
  const Result plain = predict(Plan::from_config(c)).result;
  EXPECT_NEAR(plain.hardware_tflops_per_gpu, plain.model_tflops_per_gpu, 1e-12);
}

// The summary says what size the gradient buckets are and whose default that is: a default
// that moves the step is shown (Megatron-Core's max(40M, 1M x dp) parameters: 48 replicas in
// BF16 cut 96e6-byte buckets).
TEST(Figures, TheSummaryNamesTheGradientBucketsAndWhoseSizeTheyAre) {
  ScenarioConfig c = testing::preset_replicas("gpt3-1.3b", "a100-80gb", 48, 1);
  c.precision.allreduce = DType::bf16;
  c.communication.overlap_grad_reduce = true;
  auto summary = [&] {
    const Plan plan = Plan::from_config(c);
    return format_summary(plan, predict(plan).result);
  };
  const Plan plan = Plan::from_config(c);
  const std::size_t n = plan.gradient_buckets(0).size();
  EXPECT_EQ(n, static_cast<std::size_t>(std::ceil(static_cast<double>(plan.gradient_bytes(0)) / 96e6)));
  EXPECT_NE(summary().find(fmt::format("buckets of {:.1f} MiB (Megatron-Core's max(40M, 1M x 48 replicas) parameters): "
                                       "{} a step on stage 0",
                                       96e6 / kMiB, n)),
            std::string::npos)
      << summary();
  c.communication.overlap_grad_reduce = false;
  EXPECT_NE(summary().find("one call a chunk (Megatron-Core without overlap_grad_reduce)"), std::string::npos)
      << summary();
  c.communication.bucket_size_mib = 25;
  EXPECT_NE(summary().find("buckets of 25.0 MiB (bucket_size_mib)"), std::string::npos) << summary();
  // One replica: nothing is reduced, no line.
  c.cluster.num_gpus = 1;
  c.parallelism.data_parallel_size = 1;
  c.training.global_batch_size = 1;
  EXPECT_EQ(summary().find("  buckets  "), std::string::npos);
}

// Pure data parallelism has no pipeline bubble: its idle time is exposed communication, and
// the summary says so (the plan once said "bubble 0% -> 19%" for a data-parallel change).
TEST(Figures, IdleTimeSplitsIntoPipelineBubbleAndExposedCommunication) {
  ScenarioConfig dp = small_config(ScheduleKind::one_f_one_b, 8, 1, 4);
  dp.cluster.inter_node.bandwidth_gbps = 0.01;  // make the all-reduce matter
  dp.cluster.gpus_per_node = 1;
  const Result r = predict(Plan::from_config(dp)).result;
  EXPECT_GT(r.bubble_fraction, 0.05);
  EXPECT_EQ(r.pipeline_bubble_fraction, 0.0);
  EXPECT_EQ(r.exposed_comm_fraction, r.bubble_fraction);
  // A pipeline with (nearly) free communication: its idle time is pipeline bubble; only the
  // tied embedding's sum between the first and last stage is a collective.
  ScenarioConfig pp = small_config(ScheduleKind::gpipe, 1, 4, 8);
  pp.cluster.intra_node.bandwidth_gbps = 1e6;
  pp.cluster.intra_node.latency_us = 0;
  const Result q = predict(Plan::from_config(pp)).result;
  EXPECT_NEAR(q.pipeline_bubble_fraction + q.exposed_comm_fraction, q.bubble_fraction, 1e-12);
  EXPECT_LT(q.exposed_comm_fraction, 1e-3);
  EXPECT_GT(q.pipeline_bubble_fraction, 0.2);
}

// One warning per distinct cause: 16 replicas over the GPU's memory give one sentence, not 16.
TEST(Figures, OneMemoryWarningPerDistinctNeed) {
  ScenarioConfig c = small_config(ScheduleKind::one_f_one_b, 16, 1, 2);
  c.cluster.gpus_per_node = 16;
  c.cluster.memory_gib = 0.0001;
  const Result r = predict(Plan::from_config(c)).result;
  ASSERT_FALSE(r.fits_in_memory);
  std::size_t memory_warnings = 0;
  for (const auto& w : r.warnings) memory_warnings += w.find("more than the GPU's") != std::string::npos;
  EXPECT_EQ(memory_warnings, 1u);
  bool grouped = false;
  for (const auto& w : r.warnings) grouped |= w.find("16 ranks (stage 0: ranks 0-15) need") != std::string::npos;
  EXPECT_TRUE(grouped);
  for (std::size_t i = 0; i < r.warnings.size(); ++i)
    for (std::size_t j = i + 1; j < r.warnings.size(); ++j) EXPECT_NE(r.warnings[i], r.warnings[j]);
}

// ---- both -----------------------------------------------------------------------------

TEST(Reports, SameInputGivesByteIdenticalOutput) {
  for (const auto& [name, config] : schedule_cases()) {
    SCOPED_TRACE(name);
    const Plan plan = Plan::from_config(config);
    const Prediction a = predict(plan);
    const Prediction b = predict(plan);
    EXPECT_EQ(trace_of(plan, a), trace_of(plan, b));
    EXPECT_EQ(svg_of(plan, a), svg_of(plan, b));
    EXPECT_EQ(result_to_json(a.result).dump(), result_to_json(b.result).dump());
  }
}

// ---- result JSON ------------------------------------------------------------------------

TEST(ResultJson, HasEveryDesignFieldAndMemoryAddsUp) {
  const Plan plan = Plan::from_config(small_config(ScheduleKind::one_f_one_b, 2, 4, 8));
  const Prediction p = predict(plan);
  // Through text and back, as a reader of `trainsim simulate --json` sees it.
  const json j = json::parse(result_to_json(p.result).dump(2));

  for (const char* key : {"step_time_s", "bubble_fraction", "tokens_per_s", "mfu", "allreduce_time_s",
                          "exposed_comm_time_s"})
    EXPECT_TRUE(j.contains(key) && j.at(key).is_number()) << key;
  EXPECT_TRUE(j.at("fits_in_memory").is_boolean());
  EXPECT_TRUE(j.at("warnings").is_array());
  for (const auto& w : j.at("warnings")) EXPECT_TRUE(w.is_string());
  EXPECT_GT(j.at("step_time_s").get<double>(), 0);

  ASSERT_EQ(j.at("ranks").size(), p.schedule->ranks.size());
  for (std::size_t i = 0; i < j.at("ranks").size(); ++i) {
    const json& r = j.at("ranks")[i];
    EXPECT_EQ(r.at("rank").get<int>(), p.schedule->ranks[i].rank);
    EXPECT_EQ(r.at("stage").get<int>(), p.schedule->ranks[i].stage);
    EXPECT_EQ(r.at("replica").get<int>(), p.schedule->ranks[i].replica);
    for (const char* key : {"busy_s", "idle_s", "utilization", "peak_memory_gib"})
      EXPECT_TRUE(r.contains(key) && r.at(key).is_number()) << key;
    double parts = 0;
    for (const char* key : {"weights", "gradients", "optimizer", "activations", "buffers"}) {
      ASSERT_TRUE(r.at("memory_gib").contains(key)) << key;
      parts += r.at("memory_gib").at(key).get<double>();
    }
    // Each figure is rounded to 6 significant digits: the parts may differ from the peak
    // by a few units in the 6th digit.
    const double peak = r.at("peak_memory_gib").get<double>();
    EXPECT_GT(peak, 0);
    EXPECT_NEAR(parts, peak, 5e-6 * peak);
    // busy + idle is the step.
    expect_close(r.at("busy_s").get<double>() + r.at("idle_s").get<double>(), j.at("step_time_s").get<double>(), "busy+idle");
  }
}

// write_general6 (the CSV reports' numbers) writes what fmt's "{:.6g}" writes, on values of
// every magnitude, random bit patterns, values at and next to a rounding tie (x.5 in the
// sixth digit), at and next to powers of ten, and the special values.
TEST(Format, General6EqualsPrintfG6) {
  std::vector<double> values = {0.0, -0.0, 1.0, -1.0, 0.1, 0.5, 1.5, 2.5, 1e-5, 1e-4, 9.999995e-5, 0.0001, 999999.5,
                                9999995.0, 123456.5, 1234565.0, 12345650.0, 1e6, 1e15, 1e16, 1e21, 1e22, 1e26, 1e27,
                                1e-22, 1e-23, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
                                std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                                std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::quiet_NaN()};
  std::mt19937_64 rng(20261125);
  std::uniform_real_distribution<double> mantissa(1, 10);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::uniform_int_distribution<std::int64_t> six(100000, 999999);
  for (int i = 0; i < 400000; ++i) {
    const double sign = rng() & 1 ? -1 : 1;
    values.push_back(sign * mantissa(rng) * std::pow(10.0, exponent(rng)));
    std::uint64_t bits = rng();
    double any;
    std::memcpy(&any, &bits, sizeof any);
    values.push_back(any);
    // Six digits and a half, scaled: a tie where the scaled value is exact, else within an
    // ulp of one; and its neighbours.
    const double e = std::pow(10.0, exponent(rng));
    const double tie = (static_cast<double>(six(rng)) + 0.5) * e;
    values.push_back(tie);
    values.push_back(std::nextafter(tie, 0.0));
    values.push_back(std::nextafter(tie, 1e300));
    const double round = static_cast<double>(six(rng)) * e;  // and whole six-digit values
    values.push_back(round);
    values.push_back(std::nextafter(round, 0.0));
    const double power = std::pow(10.0, exponent(rng));
    values.push_back(std::nextafter(power, 0.0));
    values.push_back(std::nextafter(power, 1e300));
  }
  int wrong = 0;
  for (double x : values) {
    char buf[kGeneral6Chars];
    const std::string got(buf, write_general6(buf, x)), want = fmt::format("{:.6g}", x);
    if (got != want && ++wrong <= 10) ADD_FAILURE() << fmt::format("{:.17g}: {} instead of {}", x, got, want);
  }
  EXPECT_EQ(wrong, 0) << "of " << values.size();
}

}  // namespace
}  // namespace trainsim
