// The CUDA backend's engine: the plan's Schedule on NVIDIA GPUs (DESIGN.md "Runtime"), driven by
// the one run loop (runtime/loop/run_loop.h) through the DeviceEngine interface
// (runtime/engine/device_engine.h), with the CPU engine's semantics (runtime/contract.h:
// numerics, overflow checks, optimizer) and its measurements taken with CUDA events.
//
// Two ways to place ranks:
//  * one GPU, every rank (Placement::launch empty): all ranks in this process, a host
//    thread pair per rank, each rank with its own compute, communication and send streams,
//    the SMs split between ranks with green contexts where the driver has them
//    (runtime/cuda/sm_partition.h), exchanging through device memory (device_world.h);
//  * one process per GPU (launch set, from torchrun/mpirun/srun variables): this process runs
//    rank launch->rank over NCCL (nccl_communicator.h); every process gathers every rank's
//    step record, so each holds the whole report (rank 0 prints it).
//
// Per rank: compute ops (forward, backward segments, receives, the optimizer step) are queued
// on the compute stream by the compute thread; collectives on the communication stream by the
// communication thread, which waits (on the device, through events) for the backward segment
// that completes a bucket, so bucket all-reduces overlap the backward that follows, as the
// schedule says; sends on the send stream, after an event on the compute stream, so a send
// never holds up the compute that follows it. The host threads run ahead of the device and
// only wait for one another's *queuing* (an event must be recorded before a stream can wait on
// it); the device does the real waiting. The last stage's forward reads its loss back, and the
// optimizer step reads the gradient norm and the overflow verdict, so those are host syncs.
//
// Timing: every op records a CUDA event before and after itself on the stream it runs on;
// times are measured from an event recorded on the rank's compute stream when the step starts.
// A collective's start event is recorded after its stream waited for its producer, so its time
// is when this rank reached it; the Timeline then starts a collective when its last member
// reaches it, as the CPU engine and the simulator do.
//
// Numerics, as the CPU engine (same StepRecord): overflow flags per rank before and after each
// gradient all-reduce (so a report can say "the bf16 all-reduce of gradient bucket 0" made the
// first inf/NaN), the largest |activation| sent and |gradient| returned, and inf/NaN counts.
//
// Checkpoints are every backend's (runtime/checkpoint.h, written by the run loop): same file, same
// plan fingerprint, so either backend resumes the other's. With one process per GPU every process
// gathers every rank's state (gather_host) and the one holding rank 0 writes the file; on resume
// every process reads it (a path all nodes see) and loads its own ranks. Master weights held in a format other
// than fp32 are rounded to it with two casts after every update (round_master).
//
// Memory: each rank's DeviceBuffers and cuBLAS workspaces are charged to its MemoryAccount, and
// its buffers in flight come from its own cudaMemPool; RunReport::allocated_peak_bytes is the
// sum of the two peaks, beside the accounted breakdown in RunReport::memory.
#pragma once

#include <memory>

#include "runtime/backend.h"
#include "runtime/contract.h"
#include "runtime/engine/device_engine.h"

namespace trainsim::runtime::cuda {

// Where the engine places ranks: runtime/contract.h's Placement (sm_sharing, launch, device).
using CudaRunOptions = Placement;

// The engine for `plan` on options.placement. Throws std::invalid_argument for what the CUDA
// backend cannot run (formats the kernels do not store), std::runtime_error when no device can be
// used (saying why).
std::unique_ptr<DeviceEngine> make_cuda_engine(const RuntimePlan& plan, const Dataset& data, const RunOptions& options);

// The CUDA backend's record (runtime/backend.h).
const Backend& cuda_backend();

// run(cuda_backend(), plan, options with `cuda` as its placement) (runtime/loop/run_loop.h).
RunReport run_cuda(const RuntimePlan& plan, const RunOptions& options, const CudaRunOptions& cuda);

}  // namespace trainsim::runtime::cuda
