// The timeline as a picture: one row per rank, its compute stream as a wide lane and its
// communication streams as a thin lane below. Every coordinate is written with a fixed
// number of decimals, so the same timeline gives a byte-identical file.
#include <algorithm>
#include <cmath>
#include <ostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "core/report/report.h"
#include "core/report/svg_kit.h"

namespace trainsim {

namespace {

// Layout, in pixels.
constexpr double kWidth = 1400;
constexpr double kLeft = 250;   // row labels live left of this
constexpr double kRight = 24;
constexpr double kPlotWidth = kWidth - kLeft - kRight;
constexpr double kComputeH = 18;
constexpr double kCommGap = 2;
constexpr double kCommH = 8;   // split into two sublanes when a schedule has collectives and p2p
constexpr double kRowGap = 10;
constexpr double kRowPitch = kComputeH + kCommGap + kCommH + kRowGap;
constexpr int kAllRows = 32;         // up to this many ranks every rank has its row; beyond, a sample (rows_to_draw)
constexpr int kMaxTooltips = 6000;   // hover text per op only for pictures with fewer ops
constexpr double kMinBoxPx = 0.5;    // a short op stays visible as a hairline
constexpr double kMergePx = 3.0;     // neighbouring ops of one kind narrower than this are drawn as one box
constexpr double kOpCharPx = 6.1;    // width of a character of the 10 px monospace op labels

// Fill classes (see the <style> block). Forward and backward have shades so that the model
// chunks of an interleaved schedule can be told apart.
constexpr int kShades = 4;
enum Fill : int {
  kForward0 = 0,
  kBackward0 = kForward0 + kShades,
  kBackwardInput = kBackward0 + kShades,
  kBackwardWeight,
  kOptimizer,
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kOverflow,
  kSendActivation,
  kSendGradient,
  kMixed,  // a band of short ops of several kinds, too narrow to draw apart
  kNumFills,
};

struct FillStyle {
  const char* cls;
  const char* colour;
  bool white_text;  // for labels drawn inside the box
};

constexpr FillStyle kFills[kNumFills] = {
    {"f0", "#2f6db5", true},  {"f1", "#7aaee3", false}, {"f2", "#1c4a82", true},  {"f3", "#a9cbef", false},
    {"b0", "#c8453b", true},  {"b1", "#eb8c83", false}, {"b2", "#8c2820", true},  {"b3", "#f3b2ab", false},
    {"bi", "#ea7a22", false}, {"bw", "#f2c74e", false}, {"op", "#3e9b5a", true},  {"ar", "#7a52a8", true},
    {"rs", "#a8559f", true},  {"ag", "#4f55c8", true},  {"oc", "#4a4a4a", true},  {"sa", "#2aa3a0", true},
    {"sg", "#84d3cd", false}, {"mx", "#8f7fa8", true},
};
constexpr const char* kIdleColour = "#e8e8ec";
constexpr const char* kCommIdleColour = "#f4f4f6";

// Which fill an op gets, or -1 for ops that are not drawn (receives: the time a receive
// keeps the compute stream waiting shows as idle).
int fill_of(const Op& op, int pp) {
  const int shade = op.chunk >= 0 ? (op.chunk / pp) % kShades : 0;
  switch (op.kind) {
    case OpKind::Forward: return kForward0 + shade;
    case OpKind::Backward: return kBackward0 + shade;
    case OpKind::BackwardInput: return kBackwardInput;
    case OpKind::BackwardWeight: return kBackwardWeight;
    case OpKind::OptimizerStep: return kOptimizer;
    case OpKind::AllReduce: return kAllReduce;
    case OpKind::ReduceScatter: return kReduceScatter;
    case OpKind::AllGather: return kAllGather;
    case OpKind::OverflowCheck: return kOverflow;
    case OpKind::SendActivation: return kSendActivation;
    case OpKind::SendGradient: return kSendGradient;
    case OpKind::RecvActivation:
    case OpKind::RecvGradient: return -1;
  }
  return -1;
}

using svg::escape;

std::string seconds_text(double s) {
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

// The unit the time axis is labelled in, chosen from the length of the step.
struct TimeUnit {
  const char* name;
  double seconds;
};
TimeUnit axis_unit(double span_s) {
  if (span_s >= 1) return {"s", 1};
  if (span_s >= 1e-3) return {"ms", 1e-3};
  return {"us", 1e-6};
}

// A round tick spacing (1, 2 or 5 times a power of ten) giving about `target` ticks.
double nice_step(double span, int target) {
  if (span <= 0) return 1;
  const double raw = span / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double n = raw / mag;
  return (n < 1.5 ? 1 : n < 3.5 ? 2 : n < 7.5 ? 5 : 10) * mag;
}

// One lane's boxes, written as they come. Neighbouring boxes of one colour that are too
// narrow to tell apart are merged, which keeps big schedules to a sane file size.
class LaneWriter {
 public:
  LaneWriter(std::string& out, double y, double h, bool labels, bool tooltips, bool& mixed)
      : out_(out), y_(y), h_(h), labels_(labels), tooltips_(tooltips), mixed_(mixed) {}
  ~LaneWriter() { flush(); }

  // Repeated narrow ops of one kind (forwards of any model chunk, backwards of any chunk, or
  // one fill) are grouped into one box, so thousands of slivers read as a band.
  void add(int fill, double x0, double x1, std::string label, std::string tooltip) {
    const double w = x1 - x0;
    if (open_ && w < kMergePx && box_.last_w < kMergePx && x0 - box_.x1 < kMergePx) {
      box_.x1 = std::max(box_.x1, x1);
      box_.last_w = w;
      box_.busy += w;
      box_.merged = true;
      box_.fill = family(fill) == family(box_.fill) ? family(fill) : kMixed;  // 1F1B's F B F B: one band
      if (box_.fill == kMixed) mixed_ = true;
      ++box_.count;
      box_.last_label = std::move(label);
      return;
    }
    flush();
    box_ = {fill, x0, x1, w, w, false, 1, std::move(label), std::move(tooltip), ""};
    open_ = true;
  }

 private:
  void flush() {
    if (!open_) return;
    open_ = false;
    const FillStyle& st = kFills[box_.fill];
    double w = std::max(box_.x1 - box_.x0, kMinBoxPx);
    // A hair of background between back-to-back ops, so F1 F2 do not read as one box.
    if (!box_.merged && w > 3) w -= 0.6;
    // A grouped band always says what it holds (bands are few: at most one per few pixels).
    const bool tip = box_.merged || (tooltips_ && !box_.tooltip.empty());
    const double filled = box_.merged ? std::clamp(box_.busy / std::max(w, 1e-9), 0.2, 1.0) : 1.0;
    out_ += fmt::format("<rect class=\"{}\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\"{}{}", st.cls,
                        box_.x0, y_, w, h_, filled < 0.95 ? fmt::format(" fill-opacity=\"{:.2f}\"", filled) : "",
                        tip ? ">" : "/>");
    if (tip && !box_.merged) out_ += fmt::format("<title>{}</title></rect>", escape(box_.tooltip));
    if (tip && box_.merged)
      out_ += fmt::format("<title>{} ops, {} .. {}</title></rect>", box_.count, escape(box_.label),
                          escape(box_.last_label));
    out_ += "\n";
    if (!labels_ || box_.merged || box_.label.empty()) return;
    // The whole label (F3, BW12) if it fits, else the micro-batch number, else nothing.
    std::string text = box_.label;
    if (text.size() * kOpCharPx + 3 > w) {
      const auto digits = text.find_first_of("0123456789");
      text = digits == std::string::npos ? "" : text.substr(digits);
    }
    if (text.empty() || text.size() * kOpCharPx + 3 > w) return;
    out_ += fmt::format("<text class=\"ol {}\" x=\"{:.2f}\" y=\"{:.2f}\">{}</text>\n", st.white_text ? "tw" : "td",
                        box_.x0 + w / 2, y_ + h_ / 2 + 3.5, escape(text));
  }

  // Forwards of every chunk shade are one family, backwards another; other fills are their own.
  static int family(int fill) {
    if (fill >= kForward0 && fill < kForward0 + kShades) return kForward0;
    if (fill >= kBackward0 && fill < kBackward0 + kShades) return kBackward0;
    return fill;
  }

  struct Box {
    int fill = 0;
    double x0 = 0, x1 = 0, last_w = 0;
    double busy = 0;  // the ops' own width; a grouped band with gaps is drawn that much opaque
    bool merged = false;
    int count = 1;
    std::string label, tooltip, last_label;
  };
  std::string& out_;
  double y_, h_;
  bool labels_, tooltips_;
  bool& mixed_;
  Box box_;
  bool open_ = false;
};

struct LegendItem {
  int fill;  // -1: idle
  std::string text;
};

// One line of the legend at `y`; item widths are estimated from character counts.
void legend_line(std::string& o, double y, const char* heading, const std::vector<LegendItem>& items) {
  o += fmt::format("<text class=\"lh\" x=\"12\" y=\"{:.2f}\">{}</text>\n", y + 9, heading);
  double x = 124;
  if (items.empty()) o += fmt::format("<text class=\"lg\" x=\"{:.2f}\" y=\"{:.2f}\">none</text>\n", x, y + 9);
  for (const auto& it : items) {
    const std::string fill = it.fill < 0 ? fmt::format("fill=\"{}\" stroke=\"#b8b8c0\"", kIdleColour)
                                         : fmt::format("class=\"{}\"", kFills[it.fill].cls);
    o += fmt::format("<rect {} x=\"{:.2f}\" y=\"{:.2f}\" width=\"16\" height=\"11\"/>\n", fill, x, y);
    o += fmt::format("<text class=\"lg\" x=\"{:.2f}\" y=\"{:.2f}\">{}</text>\n", x + 21, y + 9.5, escape(it.text));
    x += 21 + 6.6 * static_cast<double>(it.text.size()) + 22;
  }
}

// The ranks that get a row. Up to kAllRows ranks: all. Beyond, the replicas of a stage run the
// same program (their timings differ only by link placement), so each stage shows its first
// and last replica, or its first alone when that is still too many; with more stages than
// kAllRows, stages are sampled evenly, the first and last included.
std::vector<int> rows_to_draw(const Plan& plan, int nranks) {
  std::vector<int> out;
  if (nranks <= kAllRows || plan.num_ranks() != nranks) {
    for (int r = 0; r < std::min(nranks, kAllRows); ++r) out.push_back(r);
    return out;
  }
  const int p = plan.pp, d = plan.dp;
  std::vector<int> stages;
  if (p <= kAllRows) {
    for (int st = 0; st < p; ++st) stages.push_back(st);
  } else {
    for (int k = 0; k < kAllRows; ++k) {
      const int st = static_cast<int>(std::lround(static_cast<double>(k) * (p - 1) / (kAllRows - 1)));
      if (stages.empty() || stages.back() != st) stages.push_back(st);
    }
  }
  const bool both = d > 1 && 2 * static_cast<int>(stages.size()) <= kAllRows;
  for (int st : stages) {
    out.push_back(plan.rank_of(st, 0));
    if (both) out.push_back(plan.rank_of(st, d - 1));
  }
  return out;
}

std::string sample_text(const Plan& plan, int nranks) {
  const std::vector<int> rows = rows_to_draw(plan, nranks);
  const bool all_stages = plan.pp <= kAllRows;
  const bool both = plan.dp > 1 && rows.size() >= 2 && plan.replica_of(rows[1]) == plan.dp - 1 &&
                    plan.stage_of(rows[1]) == plan.stage_of(rows[0]);
  return fmt::format("{} of {} {}", both ? fmt::format("replicas 0 and {}", plan.dp - 1) : std::string("replica 0"),
                     all_stages ? "every" : "a sample of the", all_stages ? fmt::format("stage ({})", plan.pp)
                                                                           : fmt::format("{} stages", plan.pp));
}

}  // namespace

void write_timeline_svg(const Plan& plan, const Timeline& timeline, const Result& result, std::ostream& out,
                        Tick time_span) {
  const Schedule& s = *timeline.schedule;
  const auto& cfg = plan.config;
  const Tick t0 = timeline.begin();
  const Tick span = std::max<Tick>(time_span > 0 ? time_span : timeline.end() - t0, 1);
  const double span_s = ticks_to_seconds(span);
  const double px_per_tick = kPlotWidth / static_cast<double>(span);
  auto x_of = [&](Tick t) { return kLeft + static_cast<double>(t - t0) * px_per_tick; };

  const int nranks = static_cast<int>(s.ranks.size());
  const std::vector<int> drawn = rows_to_draw(plan, nranks);
  const int rows = static_cast<int>(drawn.size());
  std::vector<bool> is_drawn(static_cast<std::size_t>(nranks), false);
  for (int r : drawn) is_drawn[static_cast<std::size_t>(r)] = true;

  // What takes time in this step decides the legend and whether the thin lane is split
  // (a local found-inf check, for one, takes none and is not drawn).
  bool present[kNumFills] = {};
  std::size_t drawn_ops = 0;
  for (int r = 0; r < nranks; ++r)
    for (std::size_t i = 0; i < s.ranks[r].ops.size(); ++i) {
      const int f = fill_of(s.ranks[r].ops[i], plan.pp);
      const OpTiming& t = timeline.ops.at(r).at(i);
      if (f < 0 || t.end <= t.start) continue;
      present[f] = true;
      if (is_drawn[static_cast<std::size_t>(r)]) ++drawn_ops;
    }
  const bool tooltips = drawn_ops <= static_cast<std::size_t>(kMaxTooltips);
  bool has_collective = false, has_p2p = false;
  for (int f : {kAllReduce, kReduceScatter, kAllGather, kOverflow}) has_collective |= present[f];
  for (int f : {kSendActivation, kSendGradient}) has_p2p |= present[f];
  const bool split_comm = has_collective && has_p2p;

  std::vector<LegendItem> compute_items, comm_items;
  bool any_shaded = false;
  for (int k = 1; k < kShades; ++k) any_shaded |= present[kForward0 + k] || present[kBackward0 + k];
  const std::string shaded = any_shaded ? " (shade: model chunk)" : "";
  if (present[kForward0]) compute_items.push_back({kForward0, "forward" + shaded});
  if (present[kBackward0]) compute_items.push_back({kBackward0, "backward" + shaded});
  if (present[kBackwardInput]) compute_items.push_back({kBackwardInput, "backward (input)"});
  if (present[kBackwardWeight]) compute_items.push_back({kBackwardWeight, "backward (weight)"});
  if (present[kOptimizer]) compute_items.push_back({kOptimizer, "optimizer step"});
  compute_items.push_back({-1, "idle or waiting"});
  const std::pair<int, const char*> comm_names[] = {
      {kAllReduce, "all-reduce"},        {kReduceScatter, "reduce-scatter"},    {kAllGather, "all-gather"},
      {kOverflow, "found-inf check"},    {kSendActivation, "send activation"}, {kSendGradient, "send gradient"}};
  for (const auto& [f, name] : comm_names)
    if (present[f]) comm_items.push_back({f, name});

  // Vertical layout.
  const double legend_y = 70;
  const double axis_top_y = legend_y + 2 * 20 + 22;  // baseline of the upper tick labels
  const double rows_y = axis_top_y + 10;
  const double rows_end = rows_y + rows * kRowPitch - kRowGap;
  const double axis_bottom_y = rows_end + 18;
  const double height = axis_bottom_y + (rows < nranks ? 34 : 16);

  std::string o;
  o.reserve(4096 + drawn_ops * 96);
  o += svg::open(kWidth, height, true);
  const std::string name = cfg.name.empty() ? std::string("scenario") : cfg.name;
  o += fmt::format("<title>trainsim timeline: {} ({})</title>\n", escape(name), schedule_name(s.kind));
  o += "<style>\n"
       "text{font-family:Helvetica,Arial,sans-serif;fill:#222}\n"
       ".t{font-size:17px;font-weight:bold}\n"
       ".st{font-size:12px;fill:#555}\n"
       ".lh{font-size:12px;font-weight:bold;fill:#444}\n"
       ".lg{font-size:12px}\n"
       ".rl{font-family:Menlo,Consolas,'DejaVu Sans Mono',monospace;font-size:12px}\n"
       ".ax{font-size:11px;fill:#555;text-anchor:middle}\n"
       ".ol{font-family:Menlo,Consolas,'DejaVu Sans Mono',monospace;font-size:10px;text-anchor:middle}\n"
       ".tw{fill:#fff}\n"
       ".td{fill:#1a1a1a}\n";
  for (const auto& f : kFills) o += fmt::format(".{}{{fill:{}}}\n", f.cls, f.colour);
  o += "</style>\n";
  o += fmt::format("<rect x=\"0\" y=\"0\" width=\"{:.0f}\" height=\"{:.0f}\" fill=\"#fff\"/>\n", kWidth, height);

  // Title and what the picture is of.
  o += fmt::format("<text class=\"t\" x=\"12\" y=\"26\">{}: {} schedule, step {}, bubble {:.1f}%</text>\n",
                   escape(name), schedule_name(s.kind), seconds_text(result.step_time_s),
                   100 * result.bubble_fraction);
  std::string sub = fmt::format("{} | {} | {} micro-batches of {} per replica",
                                timeline.predicted ? "predicted" : "measured",
                                parallel_sizes_text(plan.config.parallelism), plan.num_microbatches,
                                plan.micro_batch_size);
  if (rows < nranks) sub += fmt::format(" | showing {} of {} ranks: {}", rows, nranks, sample_text(plan, nranks));
  if (!plan.source.empty()) sub += " | " + plan.source;
  o += fmt::format("<text class=\"st\" x=\"12\" y=\"46\">{}</text>\n", escape(sub));

  // The ranks' rows, drawn first so the legend can name what they needed (a band of mixed ops).
  std::string body;
  bool mixed = false;
  const TimeUnit unit = axis_unit(span_s);
  for (int row = 0; row < rows; ++row) {
    const int r = drawn[static_cast<std::size_t>(row)];
    const RankProgram& prog = s.ranks[r];
    const auto& times = timeline.ops.at(r);
    const double y = rows_y + row * kRowPitch;
    const double util = r < static_cast<int>(result.ranks.size()) ? result.ranks[r].utilization : 0;
    body += fmt::format("<g id=\"rank{}\">\n", prog.rank);
    body += fmt::format("<text class=\"rl\" xml:space=\"preserve\" x=\"12\" y=\"{:.2f}\">rank {}  s {} / d {}  util "
                     "{:.0f}%</text>\n",
                     y + 13, prog.rank, prog.stage, prog.replica, 100 * util);
    {
      const double comm_y = y + kComputeH + kCommGap;
      const double half = kCommH / 2;
      LaneWriter compute(body, y, kComputeH, true, tooltips, mixed);
      LaneWriter collective(body, comm_y, split_comm ? half : kCommH, false, tooltips, mixed);
      LaneWriter p2p(body, split_comm ? comm_y + half : comm_y, split_comm ? half : kCommH, false, tooltips, mixed);
      for (std::size_t i = 0; i < prog.ops.size(); ++i) {
        const Op& op = prog.ops[i];
        const OpTiming& t = times.at(i);
        const int fill = fill_of(op, plan.pp);
        if (fill < 0 || t.end <= t.start) continue;
        const std::string label = op_label(op);
        std::string tip;
        if (tooltips)
          tip = fmt::format("rank {}: {}{} | {:.3f}-{:.3f} {} ({})", prog.rank, label,
                            op.chunk >= 0 && plan.vpp > 1 ? fmt::format(" chunk {}", op.chunk) : "",
                            ticks_to_seconds(t.start - t0) / unit.seconds, ticks_to_seconds(t.end - t0) / unit.seconds,
                            unit.name, seconds_text(ticks_to_seconds(t.end - t.start)));
        LaneWriter& lane = is_compute(op.kind) ? compute : is_collective(op.kind) ? collective : p2p;
        lane.add(fill, x_of(t.start), x_of(t.end), label, std::move(tip));
      }
    }  // the lanes write their last boxes here, inside the row's group
    body += "</g>\n";
  }
  if (mixed) compute_items.push_back({kMixed, "short ops of several kinds, grouped (hover: how many)"});
  o += "<g id=\"legend\">\n";
  legend_line(o, legend_y, "compute", compute_items);
  legend_line(o, legend_y + 20, "communication", comm_items);
  o += "</g>\n";

  // Lane backgrounds first, the grid over them, the ops over both.
  o += "<g id=\"lanes\">\n";
  for (int row = 0; row < rows; ++row) {
    const int r = drawn[static_cast<std::size_t>(row)];
    const double y = rows_y + row * kRowPitch;
    o += fmt::format("<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"{}\"/>\n", kLeft, y,
                     kPlotWidth, kComputeH, kIdleColour);
    o += fmt::format("<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"{}\"/>\n", kLeft,
                     y + kComputeH + kCommGap, kPlotWidth, kCommH, kCommIdleColour);
    // A rule between pipeline stages when each stage has several replicas.
    if (row > 0 && plan.dp > 1 && s.ranks[r].stage != s.ranks[drawn[static_cast<std::size_t>(row) - 1]].stage)
      o += fmt::format("<line x1=\"12\" x2=\"{:.2f}\" y1=\"{:.2f}\" y2=\"{:.2f}\" stroke=\"#c4c4cc\"/>\n",
                       kWidth - kRight, y - kRowGap / 2, y - kRowGap / 2);
  }
  o += "</g>\n";

  const double step_u = nice_step(span_s / unit.seconds, 10);
  const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step_u) + 1e-9)));
  o += "<g id=\"axis\">\n";
  for (int k = 0;; ++k) {
    const double t_u = k * step_u;
    if (t_u > span_s / unit.seconds * (1 + 1e-9)) break;
    const double x = kLeft + t_u * unit.seconds / span_s * kPlotWidth;
    const std::string label = fmt::format("{:.{}f} {}", t_u, decimals, unit.name);
    o += fmt::format("<line x1=\"{0:.2f}\" x2=\"{0:.2f}\" y1=\"{1:.2f}\" y2=\"{2:.2f}\" stroke=\"#000\" "
                     "stroke-opacity=\"0.13\"/>\n",
                     x, rows_y - 4, rows_end + 4);
    o += fmt::format("<text class=\"ax\" x=\"{:.2f}\" y=\"{:.2f}\">{}</text>\n", x, axis_top_y, label);
    o += fmt::format("<text class=\"ax\" x=\"{:.2f}\" y=\"{:.2f}\">{}</text>\n", x, axis_bottom_y, label);
  }
  o += "</g>\n";

  o += body;
  if (rows < nranks)
    o += fmt::format("<text class=\"st\" x=\"12\" y=\"{:.2f}\">{} more ranks not drawn: the replicas of a stage run the "
                     "same program (the trace has every rank)</text>\n",
                     axis_bottom_y + 22, nranks - rows);
  o += svg::kClose;
  out << o;
}

void stack_svgs(const std::vector<std::string>& svgs, std::ostream& out) {
  double width = 0, height = 0;
  std::vector<double> heights;
  for (const std::string& part : svgs) {
    const std::optional<svg::Size> size = svg::size_of(part);
    if (!size) throw std::invalid_argument("stack_svgs: a part has no width and height");
    width = std::max(width, size->width);
    heights.push_back(size->height);
    height += heights.back();
  }
  out << svg::open(width, height, true);
  double y = 0;
  for (std::size_t i = 0; i < svgs.size(); ++i) {
    // A nested <svg> is placed by its x and y attributes.
    out << svg::nested(svgs[i], y);
    y += heights[i];
  }
  out << svg::kClose;
}

}  // namespace trainsim
