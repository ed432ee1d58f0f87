// Who this process is in a multi-process run (one process per GPU): its rank, the world size,
// its rank on this host (which GPU it takes) and where the rendezvous happens. The CUDA
// backend reads this before ncclCommInitRank; nothing here needs CUDA or MPI.
//
// Launchers and the variables read (first detected wins; see "Precedence"):
//
//   source              rank                  world size            local rank
//   "torchrun"          RANK                  WORLD_SIZE            LOCAL_RANK
//   "mpirun (Open MPI)" OMPI_COMM_WORLD_RANK  OMPI_COMM_WORLD_SIZE  OMPI_COMM_WORLD_LOCAL_RANK
//   "mpirun (MPICH)"    PMI_RANK              PMI_SIZE              MPI_LOCALRANKID (Hydra)
//   "srun"              SLURM_PROCID          SLURM_NTASKS          SLURM_LOCALID
//
// A launcher is detected when any of its three variables is set; it must then set all three.
// The rendezvous point (rendezvous.h) always comes from MASTER_ADDR and MASTER_PORT, whatever
// the launcher: torchrun sets them; with mpirun or srun export them yourself. With srun,
// MASTER_ADDR is typically the first host of the allocation,
//   export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
//   export MASTER_PORT=29500   # any free port, the same on every rank
// MASTER_ADDR must be an address of rank 0's host that rank 0 can listen on and every other
// rank can reach (an IPv4 or IPv6 literal or a host name).
//
// Precedence: the innermost launcher names the process. torchrun, Open MPI and MPICH all
// describe the process itself, so when several are set they must agree on rank, world size
// and local rank, or the call fails ("conflicting launcher variables"). Slurm's variables are
// read only when none of the others is set: inside an allocation they describe the srun task
// or the batch step, which is not this process under `srun torchrun` (one task per node) or
// `mpirun` inside `sbatch`. srun's PMI plugins (--mpi=pmi2) also set PMI_RANK/PMI_SIZE, but
// not Hydra's MPI_LOCALRANKID: PMI variables without MPI_LOCALRANKID that agree with
// SLURM_PROCID/SLURM_NTASKS are taken as srun's.
//
// Single process: with no launcher variable set at all the process is rank 0 of 1, local rank
// 0, source "single process", so `trainsim` started by hand runs alone without configuration.
// A world of one needs no rendezvous, so MASTER_ADDR/MASTER_PORT are then optional
// (defaults 127.0.0.1 and 29500, torchrun's) but still validated when set. A world larger than
// one requires both.
//
// Every value must be a plain decimal integer (no sign for sizes, no spaces). All errors are
// std::invalid_argument naming the variable, its value, the launcher detected and what would
// be accepted.
#pragma once

#include <functional>
#include <string>

namespace trainsim::runtime {

struct LaunchEnv {
  int rank = 0;                          // this process, in [0, world_size)
  int world_size = 1;                    // number of processes in the run
  int local_rank = 0;                    // rank among the processes on this host: the GPU it takes
  std::string master_addr = "127.0.0.1"; // rank 0's host (MASTER_ADDR)
  int master_port = 29500;               // rank 0's rendezvous port (MASTER_PORT), 1..65535
  // "torchrun", "mpirun (Open MPI)", "mpirun (MPICH)", "srun" or "single process".
  std::string source = "single process";
};

// Reads the launch variables through `getenv` (returns nullptr for an unset variable), so
// tests can inject an environment. Throws std::invalid_argument as described above.
LaunchEnv launch_env_from(const std::function<const char*(const char*)>& getenv);
// The same, reading this process's environment (::getenv).
LaunchEnv launch_env_from();

// One line for logs: "rank 3 of 8 (local rank 3) via torchrun, rendezvous at node0:29500".
std::string to_string(const LaunchEnv& env);

}  // namespace trainsim::runtime
