// The `trainsim` command as a user runs it: exit codes, where messages go, byte-identical
// output for the same input, and files written whole or not at all.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/command_helpers.h"
#include "core/hardware_profile.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace {

namespace fs = std::filesystem;

using namespace trainsim::testing;

TEST(Cli, SimulatePrintsASummary) {
  const CommandResult r = run("simulate " + kDefault);
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* s : {"step time", "tokens/s", "MFU", "bubble fraction", "all-reduce", "exposed", "memory", "warnings"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
}

TEST(Cli, SimulateListsThePricedKernelsOfEachDistinctChunk) {
  const CommandResult r = run("simulate --kernels " + kDefault);
  ASSERT_EQ(r.status, 0) << r.err;
  // The incident's four pipeline stages: the first (embedding), the last (head) and the middle
  // two, which launch the same kernels and are listed once.
  std::size_t chunks = 0;
  for (std::size_t at = r.out.find("\nvirtual stage "); at != std::string::npos; at = r.out.find("\nvirtual stage ", at + 1))
    ++chunks;
  EXPECT_EQ(chunks, 3u) << r.out;
  for (const char* s : {"embedding.forward", "linear.forward", "cross_entropy.forward", "TF/s", "GB/s", "compute-bound"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
  // Text after the JSON object would leave neither readable: refused, with nothing printed.
  const CommandResult both = run("simulate --json --kernels " + kDefault);
  EXPECT_NE(both.status, 0);
  EXPECT_EQ(both.out, "");
  EXPECT_NE(both.err.find("--kernels"), std::string::npos) << both.err;
}

TEST(Cli, JsonIsByteIdenticalAcrossRunsAndParses) {
  const CommandResult a = run("simulate --json " + kDefault), b = run("simulate --json " + kDefault);
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_EQ(a.out, b.out);
  const auto j = nlohmann::json::parse(a.out);
  EXPECT_EQ(j["ranks"].size(), 8u);
}

TEST(Cli, TraceAndSvgAreWrittenAndIdentical) {
  const fs::path d = temp_dir();
  const std::string args = "simulate " + kDefault + " --trace " + (d / "t.json").string() + " --svg " + (d / "t.svg").string();
  ASSERT_EQ(run(args).status, 0);
  const std::string trace1 = slurp(d / "t.json"), svg1 = slurp(d / "t.svg");
  ASSERT_EQ(run(args).status, 0);
  EXPECT_EQ(slurp(d / "t.json"), trace1);
  EXPECT_EQ(slurp(d / "t.svg"), svg1);
  EXPECT_TRUE(nlohmann::json::accept(trace1));
  EXPECT_EQ(svg1.rfind("<svg", 0) == 0 || svg1.rfind("<?xml", 0) == 0, true);
  EXPECT_FALSE(fs::exists(d / "t.json.tmp"));
}

TEST(Cli, BadScenarioExitsTwoWithLocatedErrorsAndNoOutput) {
  const fs::path f = temp_dir() / "bad.yaml";
  std::ofstream(f) << "cluster:\n  num_gpus: 6\nparallelism:\n  data_parallel_size: 2\n  pipeline_parallel_size: 4\n"
                      "  pipline_parallel_size: 3\n";
  const CommandResult r = run("simulate " + f.string());
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find(f.string() + ":6:3: error: parallelism.pipline_parallel_size: unknown key; did you mean \"pipeline_parallel_size\"?"), std::string::npos)
      << r.err;
}

TEST(Cli, InvariantErrorsAreReportedAfterKeysAreClean) {
  const fs::path f = temp_dir() / "bad.yaml";
  std::ofstream(f) << "cluster:\n  num_gpus: 6\nparallelism:\n  data_parallel_size: 2\n  pipeline_parallel_size: 4\n";
  const CommandResult r = run("simulate " + f.string());
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find(":4:3: error: parallelism.data_parallel_size: data_parallel_size(2) * pipeline_parallel_size(4) "
                       "* tensor_parallel_size(1) = 8 != num_gpus(6)"),
            std::string::npos)
      << r.err;
}

// `--set KEY=VALUE` runs the file as if it wrote each key: the same result as the edited file,
// byte for byte; bad overrides are errors naming --set, all of them, and nothing runs.
TEST(Cli, SetOverridesAKeyAsIfTheFileWroteIt) {
  const fs::path d = temp_dir();
  const fs::path base = d / "base.yaml", edited = d / "edited.yaml";
  const std::string common = "model: {preset: gpt3-1.3b}\ncluster: {gpu: a100-80gb, num_gpus: 16}\n"
                             "training: {micro_batch_size: 1, global_batch_size: 64}\n";
  std::ofstream(base) << common << "parallelism: {tensor_parallel_size: 2, schedule: gpipe}\n";
  std::ofstream(edited) << common << "parallelism: {tensor_parallel_size: 4, schedule: 1f1b}\n";
  const CommandResult want = run("simulate --json " + edited.string());
  ASSERT_EQ(want.status, 0) << want.err;
  const CommandResult got = run("simulate --json " + base.string() +
                                " --set parallelism.tensor_parallel_size=4 --set parallelism.schedule=1f1b");
  ASSERT_EQ(got.status, 0) << got.err;
  EXPECT_EQ(got.out, want.out);  // data_parallel_size follows the new tensor size: 16 / 4
  EXPECT_EQ(nlohmann::json::parse(got.out)["ranks"].size(), 4u);

  const CommandResult bad = run("simulate " + base.string() +
                                " --set parallelism.tensor_parallel_sise=4 --set training.micro_batch_size=x");
  EXPECT_EQ(bad.status, 2);
  EXPECT_EQ(bad.out, "");
  EXPECT_NE(bad.err.find("--set: error: parallelism.tensor_parallel_sise: unknown key; did you mean "
                         "\"tensor_parallel_size\"?"),
            std::string::npos)
      << bad.err;
  EXPECT_NE(bad.err.find("--set: error: training.micro_batch_size: expected an integer, got \"x\""), std::string::npos)
      << bad.err;
  const CommandResult malformed = run("simulate " + base.string() + " --set nothing --set =3");
  EXPECT_EQ(malformed.status, 2);
  EXPECT_NE(malformed.err.find("got \"nothing\""), std::string::npos) << malformed.err;
  EXPECT_NE(malformed.err.find("got \"=3\""), std::string::npos) << malformed.err;
}

// A published row (validation/published) runs as the scenario it states, --set included (a ratio
// row's variant is its keys set on the row): the same output as the scenario written out by hand.
TEST(Cli, APublishedRowRunsAsTheScenarioItStates) {
  const std::string row = std::string(TRAINSIM_SOURCE_DIR) + "/validation/published/zero-bubble-1.5b-m24.yaml";
  const fs::path d = temp_dir();
  const fs::path written = d / "zb.yaml";
  {
    std::ifstream in(row);
    std::ofstream out(written);
    bool inside = false;
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("scenario:", 0) == 0) {
        inside = true;
        continue;
      }
      if (inside && line.size() > 2) out << line.substr(2) << "\n";  // the section, de-indented
    }
  }
  const CommandResult want = run("simulate --json " + written.string() + " --set parallelism.schedule=zb-h1");
  ASSERT_EQ(want.status, 0) << want.err;
  const CommandResult got = run("simulate --json " + row + " --set parallelism.schedule=zb-h1");
  ASSERT_EQ(got.status, 0) << got.err;
  EXPECT_EQ(got.out, want.out);
}

// A scenario nothing fits has no redesign to prove: exit 5 as sweep and plan, saying where the
// reasons are, and nothing on stdout.
TEST(Cli, ProveOfAScenarioNothingFitsExitsFiveAndPointsAtPlan) {
  const std::string file = (fs::path(kDefault).parent_path() / "llama2-70b-on-8-gpus.yaml").string();
  const CommandResult r = run("prove " + file);
  EXPECT_EQ(r.status, 5) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("no feasible configuration"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("`trainsim plan " + file + "`"), std::string::npos) << r.err;
}

TEST(Cli, MissingFileAndUnwritableOutputAreErrorsNotCrashes) {
  CommandResult r = run("simulate /nonexistent/x.yaml");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("cannot open"), std::string::npos);
  r = run("simulate " + kDefault + " --svg /nonexistent/dir/t.svg");
  EXPECT_EQ(r.status, 3);
  EXPECT_NE(r.err.find("/nonexistent/dir/t.svg"), std::string::npos) << r.err;
}

TEST(Cli, UsageErrorsAreNotSilent) {
  const CommandResult r = run("simulate");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("FILE"), std::string::npos) << r.err;
  // Arguments a command checks itself are bad input too (exit 2), with nothing on stdout.
  for (const char* args : {"validate", "validate x.yaml --baselines y"}) {
    const CommandResult v = run(args);
    EXPECT_EQ(v.status, 2) << args;
    EXPECT_EQ(v.out, "") << args;
    EXPECT_NE(v.err.find("FILE"), std::string::npos) << v.err;
  }
}

}  // namespace

// ---- trainsim run ---------------------------------------------------------------------

namespace {

// A scenario whose runtime section finishes in well under a second.
fs::path small_run_scenario(const std::string& extra = "") {
  const fs::path p = temp_dir() / "small.yaml";
  std::ofstream(p) << "name: small-run\n"
                      "cluster: {num_gpus: 4, gpus_per_node: 4}\n"
                      "parallelism: {data_parallel_size: 2, pipeline_parallel_size: 2, schedule: 1f1b}\n"
                      "training: {micro_batch_size: 1, global_batch_size: 4}\n"
                      "precision: {compute: bf16}\n"
                      "runtime:\n"
                      "  steps: 3\n"
                      "  model: {num_layers: 4, hidden_size: 32, num_attention_heads: 2, seq_length: 16, vocab_size: 256}\n"
                   << extra;
  return p;
}

}  // namespace

TEST(Cli, RunWritesTheResultFieldsAndPerStepNumerics) {
  const fs::path dir = temp_dir();
  const CommandResult r = run("run " + small_run_scenario().string() + " --json --svg " + (dir / "run.svg").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"step_time_s", "bubble_fraction", "tokens_per_s", "allreduce_time_s", "exposed_comm_time_s",
                        "ranks", "steps"})
    EXPECT_TRUE(j.contains(k)) << k;
  ASSERT_EQ(j["ranks"].size(), 4u);
  EXPECT_GT(j["ranks"][0]["peak_memory_gib"].get<double>(), 0);
  ASSERT_EQ(j["steps"].size(), 3u);
  for (const char* k : {"step", "loss", "grad_norm", "loss_scale", "skipped", "nonfinite_count", "replica_drift"})
    EXPECT_TRUE(j["steps"][0].contains(k)) << k;
  EXPECT_NE(slurp(dir / "run.svg").find("Loss per step"), std::string::npos);
}

TEST(Cli, RunOnTheCudaBackendRunsOrSaysWhyNot) {
  const CommandResult r = run("run " + small_run_scenario().string() + " --backend cuda --steps 2");
  if (r.status == 0) {
    EXPECT_NE(r.out.find("measured on the CUDA backend"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("single-GPU world"), std::string::npos) << "says which mode ran:\n" << r.out;
  } else {
    EXPECT_EQ(r.status, 3) << r.err;
    EXPECT_TRUE(r.err.find("needs a GPU") != std::string::npos || r.err.find("built without CUDA") != std::string::npos)
        << r.err;
    EXPECT_TRUE(r.out.empty()) << "no half report: " << r.out;
  }
  // Checkpoints: written where a GPU ran the steps, in the CPU backend's format (the CPU backend
  // continues from one); nothing written where no GPU could run them.
  const fs::path ck = temp_dir() / "ck";
  const CommandResult with_checkpoints = run("run " + small_run_scenario().string() +
                                             " --backend cuda --steps 2 --checkpoint-every 1 --checkpoint-dir " +
                                             ck.string());
  if (r.status == 0) {
    ASSERT_EQ(with_checkpoints.status, 0) << with_checkpoints.err;
    EXPECT_TRUE(fs::exists(ck / "latest"));
    const CommandResult continued = run("run " + small_run_scenario().string() + " --resume " + ck.string());
    EXPECT_EQ(continued.status, 0) << continued.err;
    EXPECT_NE(continued.out.find("steps 3..3"), std::string::npos) << continued.out;
  } else {
    EXPECT_EQ(with_checkpoints.status, r.status) << with_checkpoints.err;
    EXPECT_FALSE(fs::exists(ck)) << "nothing written";
  }
  // What the CUDA backend cannot run is refused as bad input before any device work: its
  // kernels store and reduce fp32, fp16 and bf16, not a tf32 wire format.
  const fs::path tf32 = temp_dir() / "tf32-wire.yaml";
  {
    std::string text = slurp(small_run_scenario());
    text.replace(text.find("{compute: bf16}"), 15, "{compute: bf16, allreduce: tf32}");
    std::ofstream(tf32) << text;
  }
  const CommandResult refused = run("run " + tf32.string() + " --backend cuda");
  if (refused.err.find("built without CUDA") == std::string::npos) {
    EXPECT_EQ(refused.status, 2) << refused.err;
    EXPECT_NE(refused.err.find("tf32"), std::string::npos) << refused.err;
  }
}

// calibrate and validate on the CUDA backend: a GPU's profile and a GPU run where there is one;
// elsewhere a clear error and nothing written.
TEST(Cli, CalibrateAndValidateOnTheCudaBackendOrSayWhyNot) {
  const fs::path profile = temp_dir() / "cuda-profile.yaml";
  const CommandResult cal =
      run("calibrate " + small_run_scenario().string() + " --backend cuda --max-mib 1 -o " + profile.string());
  const CommandResult val = run("validate " + small_run_scenario().string() + " --backend cuda --steps 2");
  if (cal.status == 0) {
    EXPECT_NE(cal.out.find("CUDA events"), std::string::npos) << cal.out;
    EXPECT_NE(slurp(profile).find("backend: cuda"), std::string::npos);
    ASSERT_EQ(val.status, 0) << val.err;
    EXPECT_NE(val.out.find("measured on the CUDA backend"), std::string::npos) << val.out;
    const CommandResult with_profile = run("validate " + small_run_scenario().string() +
                                           " --backend cuda --steps 2 --profile " + profile.string());
    EXPECT_EQ(with_profile.status, 0) << with_profile.err;
    return;
  }
  for (const CommandResult* r : {&cal, &val}) {
    EXPECT_EQ(r->status, 3) << r->err;
    EXPECT_TRUE(r->err.find("needs a GPU") != std::string::npos || r->err.find("built without CUDA") != std::string::npos)
        << r->err;
    EXPECT_TRUE(r->out.empty()) << "no half report: " << r->out;
  }
  EXPECT_FALSE(fs::exists(profile)) << "nothing written";
}

TEST(Cli, RunOfTheIncidentReportsWhereItFailed) {
  // The default scenario as it is: fp16, static scale, fp16 all-reduce summed before
  // dividing, local overflow checks. It must end with a report, not a crash.
  const CommandResult r = run("run " + kDefault + " --steps 6");
  EXPECT_TRUE(r.status == 0 || r.status == 4) << r.err;
  if (r.status == 4) {
    EXPECT_NE(r.out.find("RUN FAILED"), std::string::npos);
    EXPECT_NE(r.out.find("first appeared at step"), std::string::npos) << r.out;
  }
  EXPECT_NE(r.out.find("loss"), std::string::npos);
}

TEST(Cli, RunRefusesACorruptCheckpointAndABadRuntimeSection) {
  const fs::path dir = temp_dir();
  const fs::path bad = dir / "bad.ckpt";
  std::ofstream(bad) << "TSCKPT this is not a checkpoint";
  CommandResult r = run("run " + small_run_scenario().string() + " --resume " + bad.string());
  EXPECT_EQ(r.status, 3);
  EXPECT_NE(r.err.find("bad.ckpt"), std::string::npos) << r.err;

  const fs::path deep = dir / "deep.yaml";
  std::ofstream(deep) << "cluster: {num_gpus: 8, gpus_per_node: 8}\n"
                         "parallelism: {pipeline_parallel_size: 8, data_parallel_size: 1}\n"
                         "training: {micro_batch_size: 1, global_batch_size: 8}\n"
                         "runtime:\n"
                         "  model: {num_layers: 4}\n";
  r = run("run " + deep.string());
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("deep.yaml:5"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("runtime.model.num_layers"), std::string::npos) << r.err;
}

TEST(Cli, RunResumesFromItsCheckpointWithIdenticalLosses) {
  const fs::path dir = temp_dir() / "ckpt";
  const std::string file = small_run_scenario().string();
  const CommandResult whole = run("run " + file + " --json --steps 4 --checkpoint-dir " + dir.string() +
                                  " --checkpoint-every 2");
  ASSERT_EQ(whole.status, 0) << whole.err;
  const CommandResult rest = run("run " + file + " --json --steps 4 --resume " + (dir / "step-2.ckpt").string());
  ASSERT_EQ(rest.status, 0) << rest.err;
  const auto a = nlohmann::json::parse(whole.out)["steps"], b = nlohmann::json::parse(rest.out)["steps"];
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0]["loss"], a[2]["loss"]);
  EXPECT_EQ(b[1]["loss"], a[3]["loss"]);
}

namespace {

// A two-stage plan of a tiny model: validated in about a second. `cluster` replaces the
// cluster line (to name a profile).
fs::path tiny_scenario(const fs::path& dir, const std::string& cluster = "cluster: {num_gpus: 2, gpus_per_node: 2}") {
  const fs::path f = dir / "tiny.yaml";
  std::ofstream(f) << "name: tiny\n" << cluster << "\n"
                   << "parallelism: {pipeline_parallel_size: 2, schedule: 1f1b}\n"
                      "training: {micro_batch_size: 2, global_batch_size: 8}\n"
                      "precision: {compute: fp32, grad_accumulation: fp32, allreduce: fp32, loss_scaling: {mode: none}}\n"
                      "runtime:\n  steps: 3\n"
                      "  model: {num_layers: 2, hidden_size: 64, num_attention_heads: 2, seq_length: 32, vocab_size: 256}\n"
                      "  data: {synthetic: true}\n";
  return f;
}

}  // namespace

TEST(Cli, ValidatePrintsPredictedMeasuredAndTheirErrors) {
  const fs::path dir = temp_dir();
  const fs::path f = tiny_scenario(dir);
  const CommandResult r = run("validate " + f.string() + " --json --trace " + (dir / "t.json").string() + " --svg " +
                              (dir / "t.svg").string() + " --save-profile " + (dir / "p.yaml").string());
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  // The profile the prediction used, as a file `--profile` and `cluster.profile` read.
  const trainsim::HardwareProfile saved = trainsim::load_profile((dir / "p.yaml").string());
  EXPECT_EQ(saved.name, j["profile"].get<std::string>());
  EXPECT_FALSE(saved.kernels.empty());
  for (const char* k : {"predicted", "measured", "error", "numerics", "machine_drift"}) EXPECT_TRUE(j.contains(k)) << k;
  for (const char* k : {"step_time_s", "bubble_fraction", "allreduce_time_s", "ranks"})
    EXPECT_TRUE(j["error"].contains(k)) << k;
  ASSERT_EQ(j["predicted"]["ranks"].size(), 2u);
  ASSERT_EQ(j["measured"]["ranks"].size(), 2u);
  // The error is what the two sides say it is.
  const double p = j["predicted"]["step_time_s"], m = j["measured"]["step_time_s"];
  EXPECT_NEAR(j["error"]["step_time_s"].get<double>(), (p - m) / m, 1e-4);
  EXPECT_TRUE(j["numerics"]["stable"].get<bool>());
  EXPECT_EQ(j["measured"]["steps"].size(), 3u);
  // One trace with both timelines (measured ranks from process 1000), one SVG with both pictures.
  const auto trace = nlohmann::json::parse(slurp(dir / "t.json"));
  int predicted = 0, measured = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") (e["pid"].get<int>() >= 1000 ? measured : predicted)++;
  EXPECT_GT(predicted, 0);
  EXPECT_GT(measured, 0);
  const std::string svg = slurp(dir / "t.svg");
  EXPECT_NE(svg.find("predicted |"), std::string::npos);
  EXPECT_NE(svg.find("measured |"), std::string::npos);
}

// A context-parallel plan is calibrated, predicted and run like any other: at one sequence a
// micro-batch the rank's rows are fewer than a sequence's (the calibrator's embedding once wrote a
// whole sequence's rows into them: found by `prove` of the long-context library scenario).
TEST(Cli, ValidateComparesAContextParallelPlan) {
  const fs::path dir = temp_dir();
  const fs::path f = dir / "cp.yaml";
  std::ofstream(f) << "name: cp\ncluster: {num_gpus: 2, gpus_per_node: 2}\n"
                      "parallelism: {context_parallel_size: 2}\n"
                      "training: {micro_batch_size: 1, global_batch_size: 4}\n"
                      "precision: {compute: fp32, grad_accumulation: fp32, allreduce: fp32, loss_scaling: {mode: none}}\n"
                      "runtime:\n  steps: 3\n"
                      "  model: {num_layers: 2, hidden_size: 64, num_attention_heads: 2, seq_length: 32, vocab_size: 256}\n"
                      "  data: {synthetic: true}\n";
  const CommandResult r = run("validate " + f.string() + " --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["numerics"]["stable"].get<bool>());
  EXPECT_GT(j["predicted"]["step_time_s"].get<double>(), 0);
  EXPECT_EQ(j["measured"]["ranks"].size(), 1u) << "one schedule rank: its two context-parallel ranks";
}

TEST(Cli, CalibrateWritesAProfileThatAScenarioNamesLikeAPreset) {
  const fs::path dir = temp_dir();
  const fs::path f = tiny_scenario(dir);
  const CommandResult c = run("calibrate " + f.string() + " --max-mib 1 -o " + (dir / "cpu.yaml").string());
  ASSERT_EQ(c.status, 0) << c.err;
  // The communication table as nccl-tests prints it, with its data check; then the kernels.
  for (const char* s : {"#wrong", "busbw", "all_reduce", "sendrecv", "Out of bounds values : 0 OK", "linear.forward"})
    EXPECT_NE(c.out.find(s), std::string::npos) << s;
  // Measured in every format the CPU backend runs, whatever the scenario's own.
  const std::string profile = slurp(dir / "cpu.yaml");
  for (const char* d : {"dtype: fp32", "dtype: tf32", "dtype: fp16", "dtype: bf16"})
    EXPECT_NE(profile.find(d), std::string::npos) << d;
  // Both ranks on cores of their own (a host of two cores or more): their stages and their
  // optimizer updates timed side by side.
  if (std::thread::hardware_concurrency() >= 2) {
    EXPECT_NE(profile.find("\ncore_factors:"), std::string::npos) << profile;
    EXPECT_NE(profile.find("optimizer_core_factors:"), std::string::npos) << profile;
  }
  // A scenario beside the profile names it by a relative path, like a GPU preset.
  fs::create_directories(dir / "named");
  fs::copy_file(dir / "cpu.yaml", dir / "named" / "cpu.yaml");
  const fs::path named = tiny_scenario(dir / "named", "cluster: {profile: cpu.yaml, num_gpus: 2}");
  const CommandResult s = run("simulate " + named.string() + " --json");
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_GT(nlohmann::json::parse(s.out)["step_time_s"].get<double>(), 0);
  const CommandResult v = run("validate " + f.string() + " --profile " + (dir / "cpu.yaml").string() + " --json");
  ASSERT_EQ(v.status, 0) << v.err;
  EXPECT_EQ(nlohmann::json::parse(v.out)["profile"], "cpu-tiny");
  // A profile that is not there is a located scenario error, not a crash.
  const fs::path missing = tiny_scenario(dir / "named", "cluster: {profile: nowhere.yaml, num_gpus: 2}");
  const CommandResult e = run("simulate " + missing.string());
  EXPECT_EQ(e.status, 2);
  EXPECT_NE(e.err.find("cluster.profile"), std::string::npos) << e.err;
}

TEST(Cli, ProveTellsTheIncidentAndWritesItsReport) {
  const fs::path dir = temp_dir() / "report";
  const CommandResult r = run("prove " + kDefault + " --steps 3 --report " + dir.string());
  ASSERT_EQ(r.status, 0) << r.err;
  // The original fails numerically (FP16, static scale, sum before divide); the redesign does not.
  const std::size_t redesign = r.out.find("\nredesign\n"), changes = r.out.find("\nwhat the plan changed");
  ASSERT_NE(redesign, std::string::npos);
  ASSERT_NE(changes, std::string::npos);
  EXPECT_NE(r.out.substr(0, redesign).find("UNSTABLE"), std::string::npos);
  EXPECT_EQ(r.out.substr(redesign, changes - redesign).find("UNSTABLE"), std::string::npos);
  const std::string md = slurp(dir / "report.md");
  for (const char* s : {"## Verdict", "## The original", "## The redesign", "| step time |", "| bubble |"})
    EXPECT_NE(md.find(s), std::string::npos) << s;
  // Every picture the report shows is there.
  for (std::size_t at = md.find("]("); at != std::string::npos; at = md.find("](", at + 1)) {
    const std::string name = md.substr(at + 2, md.find(')', at) - at - 2);
    EXPECT_TRUE(fs::exists(dir / name)) << name;
  }
}
