#include "runtime/launch/launch_env.h"

#include <charconv>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace trainsim::runtime {
namespace {

using Getenv = std::function<const char*(const char*)>;

struct Launcher {
  const char* source;
  const char* rank_var;
  const char* size_var;
  const char* local_var;
};

// In order of precedence (launch_env.h): the first three describe the process itself; Slurm's
// variables are read only when none of them is set.
constexpr Launcher kTorchrun{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"};
constexpr Launcher kOpenMpi{"mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK"};
constexpr Launcher kMpich{"mpirun (MPICH)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"};
constexpr Launcher kSrun{"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"};

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("launch environment: " + what); }

std::optional<std::string> lookup(const Getenv& getenv, const char* name) {
  const char* v = getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

// A plain decimal integer: optional '-', digits, nothing else.
int parse_int(const char* name, const std::string& value, const std::string& context) {
  int out = 0;
  const char* first = value.data();
  const char* last = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(first, last, out);
  if (ec == std::errc::result_out_of_range)
    fail(std::string(name) + "='" + value + "' is out of range (" + context + ")");
  if (value.empty() || ec != std::errc() || ptr != last)
    fail(std::string(name) + "='" + value + "' is not an integer (" + context +
         "); expected a plain decimal number such as 0 or 8");
  return out;
}

// One launcher's variables as found in the environment.
struct Reading {
  const Launcher* launcher = nullptr;
  std::optional<std::string> rank, size, local;

  bool detected() const { return rank || size || local; }

  // "torchrun detected (RANK, WORLD_SIZE set)"
  std::string context() const {
    std::string set;
    auto add = [&](const char* name, const std::optional<std::string>& v) {
      if (!v) return;
      if (!set.empty()) set += ", ";
      set += name;
    };
    add(launcher->rank_var, rank);
    add(launcher->size_var, size);
    add(launcher->local_var, local);
    return std::string(launcher->source) + " detected: " + set + " set";
  }
};

Reading read(const Getenv& getenv, const Launcher& l) {
  Reading r;
  r.launcher = &l;
  r.rank = lookup(getenv, l.rank_var);
  r.size = lookup(getenv, l.size_var);
  r.local = lookup(getenv, l.local_var);
  return r;
}

struct Parsed {
  const Launcher* launcher = nullptr;
  int rank = 0, size = 1, local = 0;
};

// All three variables present, integers and in range.
Parsed parse(const Reading& r) {
  const Launcher& l = *r.launcher;
  std::vector<const char*> missing;
  if (!r.rank) missing.push_back(l.rank_var);
  if (!r.size) missing.push_back(l.size_var);
  if (!r.local) missing.push_back(l.local_var);
  if (!missing.empty()) {
    std::string names;
    for (const char* m : missing) names += (names.empty() ? "" : ", ") + std::string(m);
    std::string msg = r.context() + ", but " + names + (missing.size() == 1 ? " is" : " are") +
                      " not set; " + l.source + " must set " + l.rank_var + ", " + l.size_var + " and " +
                      l.local_var;
    if (&l == &kMpich && missing.size() == 1 && !r.local)
      msg += " (Hydra's mpirun sets MPI_LOCALRANKID; under srun, PMI_RANK/PMI_SIZE are taken as srun's "
             "when SLURM_PROCID/SLURM_NTASKS agree with them)";
    fail(msg);
  }
  const std::string ctx = r.context();
  Parsed p;
  p.launcher = &l;
  p.rank = parse_int(l.rank_var, *r.rank, ctx);
  p.size = parse_int(l.size_var, *r.size, ctx);
  p.local = parse_int(l.local_var, *r.local, ctx);
  if (p.size < 1)
    fail(std::string(l.size_var) + "=" + std::to_string(p.size) + " must be at least 1 (" + ctx + ")");
  if (p.rank < 0 || p.rank >= p.size)
    fail(std::string(l.rank_var) + "=" + std::to_string(p.rank) + " is outside [0, " + l.size_var + "=" +
         std::to_string(p.size) + ") (" + ctx + ")");
  if (p.local < 0 || p.local >= p.size)
    fail(std::string(l.local_var) + "=" + std::to_string(p.local) + " is outside [0, " + l.size_var + "=" +
         std::to_string(p.size) + ") (" + ctx + ")");
  return p;
}

void check_agree(const Parsed& a, const Parsed& b) {
  auto field = [&](const char* what, const char* a_var, int av, const char* b_var, int bv) {
    if (av == bv) return;
    fail(std::string("conflicting launcher variables: ") + a_var + "=" + std::to_string(av) + " (" +
         a.launcher->source + ") but " + b_var + "=" + std::to_string(bv) + " (" + b.launcher->source +
         "); both describe this process's " + what +
         ", so they must agree: unset the stale ones or start the process with one launcher");
  };
  field("rank", a.launcher->rank_var, a.rank, b.launcher->rank_var, b.rank);
  field("world size", a.launcher->size_var, a.size, b.launcher->size_var, b.size);
  field("local rank", a.launcher->local_var, a.local, b.launcher->local_var, b.local);
}

// Integer value of an optional variable, or nullopt when it is unset or not an integer.
std::optional<int> try_int(const std::optional<std::string>& v) {
  if (!v || v->empty()) return std::nullopt;
  int out = 0;
  const auto [ptr, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
  if (ec != std::errc() || ptr != v->data() + v->size()) return std::nullopt;
  return out;
}

}  // namespace

LaunchEnv launch_env_from(const Getenv& getenv) {
  Reading torchrun = read(getenv, kTorchrun);
  Reading openmpi = read(getenv, kOpenMpi);
  Reading mpich = read(getenv, kMpich);
  Reading srun = read(getenv, kSrun);

  // srun's PMI plugins set PMI_RANK/PMI_SIZE but not MPI_LOCALRANKID: those are srun's.
  if (mpich.detected() && !mpich.local && srun.detected()) {
    const auto mr = try_int(mpich.rank), ms = try_int(mpich.size);
    if (mr && ms && mr == try_int(srun.rank) && ms == try_int(srun.size)) mpich = Reading{&kMpich, {}, {}, {}};
  }

  LaunchEnv env;
  std::string context = "no launcher variables set: single process";
  std::vector<Parsed> primaries;
  for (const Reading* r : {&torchrun, &openmpi, &mpich})
    if (r->detected()) primaries.push_back(parse(*r));
  std::optional<Parsed> chosen;
  if (!primaries.empty()) {
    for (std::size_t i = 1; i < primaries.size(); ++i) check_agree(primaries[0], primaries[i]);
    chosen = primaries[0];
    context = (torchrun.detected() ? torchrun : openmpi.detected() ? openmpi : mpich).context();
  } else if (srun.detected()) {
    chosen = parse(srun);
    context = srun.context();
  }
  if (chosen) {
    env.rank = chosen->rank;
    env.world_size = chosen->size;
    env.local_rank = chosen->local;
    env.source = chosen->launcher->source;
  }

  const auto addr = lookup(getenv, "MASTER_ADDR");
  const auto port = lookup(getenv, "MASTER_PORT");
  if (env.world_size > 1 && (!addr || !port)) {
    std::string missing = !addr && !port ? "MASTER_ADDR and MASTER_PORT are" : !addr ? "MASTER_ADDR is" : "MASTER_PORT is";
    std::string msg = missing + " not set (" + context + ", world size " + std::to_string(env.world_size) +
                      "); every rank needs rank 0's address and a free port, the same on every rank";
    if (env.source == kSrun.source)
      msg += ", e.g. export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) "
             "MASTER_PORT=29500";
    else if (env.source != kTorchrun.source)
      msg += ", e.g. export MASTER_ADDR=<rank 0's host> MASTER_PORT=29500 (mpirun -x MASTER_ADDR -x MASTER_PORT "
             "forwards them)";
    fail(msg);
  }
  if (addr) {
    if (addr->empty()) fail("MASTER_ADDR is empty (" + context + "); expected rank 0's host name or IP address");
    env.master_addr = *addr;
  }
  if (port) {
    const int p = parse_int("MASTER_PORT", *port, context);
    if (p < 1 || p > 65535)
      fail("MASTER_PORT=" + *port + " is outside 1..65535 (" + context + ")");
    env.master_port = p;
  }
  return env;
}

LaunchEnv launch_env_from() {
  return launch_env_from([](const char* name) -> const char* { return std::getenv(name); });
}

std::string to_string(const LaunchEnv& env) {
  return "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + " (local rank " +
         std::to_string(env.local_rank) + ") via " + env.source + ", rendezvous at " + env.master_addr + ":" +
         std::to_string(env.master_port);
}

}  // namespace trainsim::runtime
