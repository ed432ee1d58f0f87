// The launch environment (runtime/launch/launch_env.h): the variables torchrun, mpirun and srun
// set, read before a multi-process run starts. The input is an environment, one NAME=VALUE a
// line. Whatever it holds, launch_env_from either throws std::invalid_argument or returns a
// place in a world: 0 <= rank < world_size, 0 <= local_rank < world_size, a port in 1..65535
// and a non-empty rendezvous address.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>

#include "runtime/launch/launch_env.h"

namespace {

void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_launch_env: property violated: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // An environment holds C strings: a NUL ends the value, as getenv would see it.
  std::map<std::string, std::string> env;
  std::string text(reinterpret_cast<const char*>(data), size);
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    const std::size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string name = line.substr(0, eq), value = line.substr(eq + 1);
    name = name.substr(0, name.find('\0'));
    value = value.substr(0, value.find('\0'));
    env[name] = value;  // the last assignment wins, as in a shell
  }
  try {
    const trainsim::runtime::LaunchEnv e = trainsim::runtime::launch_env_from([&](const char* name) -> const char* {
      auto it = env.find(name);
      return it == env.end() ? nullptr : it->second.c_str();
    });
    require(e.world_size >= 1, "world_size >= 1");
    require(e.rank >= 0 && e.rank < e.world_size, "0 <= rank < world_size");
    require(e.local_rank >= 0 && e.local_rank < e.world_size, "0 <= local_rank < world_size");
    require(e.master_port >= 1 && e.master_port <= 65535, "port in 1..65535");
    require(!e.master_addr.empty(), "a rendezvous address");
    (void)trainsim::runtime::to_string(e);
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
