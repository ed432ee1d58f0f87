// `trainsim calibrate --backend cpu`: the CPU backend's kernel calibrator (runtime/calibrate/
// calibrate.h's method) and its profile. Each kernel of the plan's inventory is timed with the
// runtime's own implementation of it (runtime/model/layers.h, runtime/numerics/) on buffers of
// fresh random values, on a thread pinned to core 0 like rank 0's compute thread; its stage of
// the runtime's own blocks runs alone on core 0 and on every rank's core at once.
#pragma once

#include <memory>
#include <string>

#include "core/hardware_profile.h"
#include "runtime/calibrate/calibrate.h"
#include "runtime/runtime_plan.h"

namespace trainsim::runtime {

class CpuKernelCalibrator final : public KernelCalibrator {
 public:
  CpuKernelCalibrator(const RuntimePlan& plan, const CalibrateOptions& options);
  ~CpuKernelCalibrator() override;
  std::string placement() const override;

 private:
  void on_timing_thread(const std::function<void()>& body) override;
  double time_kernel(std::size_t i) override;
  std::pair<double, double> time_stage() override;
  std::vector<double> time_stages_together() override;
  int stage_ranks() const override;

  struct State;
  std::unique_ptr<State> s_;
};

// A profile with the machine's description and no rates yet.
HardwareProfile describe_cpu_profile(const RuntimePlan& plan, const std::string& name);
// The machine's CPU model and core count, for the profile's `device`.
std::string cpu_description();
// calibrate_profile(cpu_backend(), ...).
HardwareProfile calibrate_cpu(const RuntimePlan& plan, const std::string& name, const CalibrateOptions& options,
                              CommBenchResult* comm_table = nullptr);

}  // namespace trainsim::runtime
