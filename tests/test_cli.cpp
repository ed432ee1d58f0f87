// The `trainsim` command as a user runs it: exit codes, where messages go, byte-identical
// output for the same input, and files written whole or not at all.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/wait.h>

namespace {

namespace fs = std::filesystem;

struct CommandResult {
  int status = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path temp_dir() {
  const fs::path d = fs::temp_directory_path() /
                     ("trainsim_cli_" + std::to_string(::getpid()) + "_" +
                      ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::create_directories(d);
  return d;
}

CommandResult run(const std::string& args) {
  const fs::path err = temp_dir() / "stderr.txt";
  const std::string cmd = std::string(TRAINSIM_EXE) + " " + args + " 2>" + err.string();
  CommandResult r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.out.append(buf, n);
  const int st = ::pclose(pipe);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.err = slurp(err);
  return r;
}

const std::string kDefault = std::string(TRAINSIM_SOURCE_DIR) + "/scenarios/postmortem-8x40gb.yaml";

TEST(Cli, SimulatePrintsASummary) {
  const CommandResult r = run("simulate " + kDefault);
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* s : {"step time", "tokens/s", "MFU", "bubble fraction", "all-reduce", "exposed", "memory", "warnings"})
    EXPECT_NE(r.out.find(s), std::string::npos) << s;
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
}

}  // namespace
