// The --backend choice of run, calibrate, validate and prove: the CPU backend, or the CUDA one
// where this trainsim was built with nvcc. The only file of the front end that names the CUDA
// backend's functions.
#include <stdexcept>

#include "cli/commands.h"
#include "core/scenario.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/exec/executor.h"
#include "runtime/launch/launch_env.h"
#include "validation/validate.h"
#if TRAINSIM_HAVE_CUDA
#include "runtime/cuda/calibrate_cuda.h"
#include "runtime/cuda/executor_cuda.h"
#endif

namespace trainsim::cli {

namespace {

#if !TRAINSIM_HAVE_CUDA
[[noreturn]] void no_cuda() {
  throw std::runtime_error("this trainsim was built without CUDA (no nvcc at configure time); use --backend cpu");
}
#endif

#if TRAINSIM_HAVE_CUDA
// Calibration and validation place every rank on one GPU in this process; under a launcher each
// process would calibrate its own copy of the whole plan.
void refuse_launcher(const char* command) {
  if (runtime::launch_env_from().world_size > 1)
    throw std::runtime_error(std::string(command) +
                             " --backend cuda runs every rank of the plan on one GPU in one process: start it without "
                             "torchrun/mpirun/srun (a launched run is `trainsim run --backend cuda`)");
}

runtime::cuda::SmSharing sm_sharing_of(const BackendChoice& backend) {
  return backend.sm_sharing == "green"    ? runtime::cuda::SmSharing::green_contexts
         : backend.sm_sharing == "shared" ? runtime::cuda::SmSharing::shared
                                          : runtime::cuda::SmSharing::automatic;
}
#endif

}  // namespace

void add_backend_options(CLI::App* sub, BackendChoice& backend) {
  sub->add_option("--backend", backend.name,
                  "cpu (threads, Eigen) or cuda (cuBLAS, our kernels; NCCL under a launcher). Default: the "
                  "scenario's runtime.backend")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  sub->add_option("--sm-sharing", backend.sm_sharing,
                  "cuda, all ranks on one GPU: split the SMs between ranks with green contexts (green), let ranks "
                  "share every SM (shared), or green where the driver allows it (auto)")
      ->check(CLI::IsMember({"auto", "green", "shared"}));
  sub->add_option("--device", backend.device, "cuda, all ranks on one GPU: which GPU")->check(CLI::NonNegativeNumber);
}

BackendChoice backend_for(const Scenario& scenario, const CLI::App& sub, BackendChoice choice) {
  if (sub.count("--backend") == 0 && scenario.config.runtime.backend == RuntimeBackend::cuda) choice.name = "cuda";
  return choice;
}

runtime::RunReport run_on_backend(const runtime::RuntimePlan& rp, const runtime::RunOptions& options,
                                  const BackendChoice& backend) {
  if (backend.name != "cuda") return runtime::run_cpu(rp, options);
#if TRAINSIM_HAVE_CUDA
  runtime::cuda::CudaRunOptions cuda;
  cuda.sm_sharing = sm_sharing_of(backend);
  cuda.device = backend.device;
  // Started by torchrun, mpirun or srun with more than one process: one rank per process over
  // NCCL. Otherwise every rank of the plan shares one GPU in this process.
  const runtime::LaunchEnv env = runtime::launch_env_from();
  if (env.world_size > 1) cuda.launch = env;
  return runtime::cuda::run_cuda(rp, options, cuda);
#else
  no_cuda();
#endif
}

bool prints_output(const BackendChoice& backend) {
  if (backend.name != "cuda") return true;
  return runtime::launch_env_from().rank == 0;  // one process per GPU: rank 0 reports
}

HardwareProfile calibrate_on_backend(const runtime::RuntimePlan& rp, const std::string& name,
                                     const runtime::CalibrateOptions& options, const BackendChoice& backend,
                                     runtime::CommBenchResult* comm_table) {
  if (backend.name != "cuda") return runtime::calibrate_cpu(rp, name, options, comm_table);
#if TRAINSIM_HAVE_CUDA
  refuse_launcher("calibrate");
  runtime::cuda::CudaCalibrateOptions cuda;
  cuda.device = backend.device;
  cuda.sm_sharing = sm_sharing_of(backend);
  return runtime::cuda::calibrate_cuda(rp, name, options, cuda, comm_table);
#else
  no_cuda();
#endif
}

validation::ValidationBackend validation_backend(const BackendChoice& backend, const char* command) {
  validation::ValidationBackend v;
  if (backend.name != "cuda") return v;  // the CPU backend: validate's own calibration between steps
#if TRAINSIM_HAVE_CUDA
  refuse_launcher(command);
  v.name = "cuda";
  v.calibrate = [backend](const runtime::RuntimePlan& rp, const runtime::CalibrateOptions& options) {
    return calibrate_on_backend(rp, "cuda-" + rp.plan.config.name, options, backend, nullptr);
  };
  v.run = [backend](const runtime::RuntimePlan& rp, const runtime::RunOptions& options) {
    return run_on_backend(rp, options, backend);
  };
  return v;
#else
  (void)command;
  no_cuda();
#endif
}

}  // namespace trainsim::cli
