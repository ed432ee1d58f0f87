// Running the `trainsim` command from a test as a user would: its exit status, stdout and
// stderr, in a folder per test that is removed when the test program ends.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace trainsim::testing {

namespace fs = std::filesystem;

struct CommandResult {
  int status = -1;
  std::string out, err;
};

inline std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The bundled default scenario (the README's first command runs it).
inline const std::string kDefault = std::string(TRAINSIM_SOURCE_DIR) + "/scenarios/postmortem-8x40gb.yaml";

// The bundled incident's configuration alone: its own `sweep:` and `constraints:` sections
// (top-level blocks) are dropped, so tests choose their own.
inline std::string postmortem_text() {
  std::istringstream in(slurp(kDefault));
  std::string out, line;
  bool skipping = false;
  while (std::getline(in, line)) {
    const bool top_level_key = !line.empty() && line[0] != ' ' && line[0] != '#';
    if (top_level_key) skipping = line.rfind("sweep:", 0) == 0 || line.rfind("constraints:", 0) == 0;
    if (!skipping) out += line + "\n";
  }
  return out;
}

inline std::string temp_prefix() { return "trainsim_test_" + std::to_string(::getpid()) + "_"; }

// This test's own folder.
inline fs::path temp_dir() {
  const fs::path d = fs::temp_directory_path() /
                     (temp_prefix() + ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::create_directories(d);
  return d;
}

// Removes every folder temp_dir() made in this process.
class RemoveTempDirs : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(fs::temp_directory_path(), ec))
      if (e.path().filename().string().rfind(temp_prefix(), 0) == 0) fs::remove_all(e.path(), ec);
  }
};
inline const auto* const kRemoveTempDirs = ::testing::AddGlobalTestEnvironment(new RemoveTempDirs);

// Runs `trainsim ARGS` (TRAINSIM_EXE), capturing stdout, and stderr through a file.
inline CommandResult run(const std::string& args) {
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

}  // namespace trainsim::testing
