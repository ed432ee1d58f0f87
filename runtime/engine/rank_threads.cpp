#include "runtime/engine/rank_threads.h"

#include <stdexcept>
#include <thread>

#include <fmt/format.h>

namespace trainsim::runtime {

std::string error_text(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

void RankWalk::note_failure() {
  std::int64_t none = 0;
  failed_at_ns_.compare_exchange_strong(none, failure_clock_ns());  // the first of the two threads' errors
}

std::exception_ptr RankWalk::run(int rank, const RankProgram& program, RankDriver& driver,
                                 const InjectedFault* fault) {
  comm_error_ = nullptr;
  failed_at_ns_.store(0);
  std::exception_ptr error;
  driver.on_thread(RankThread::compute, [&] { error = compute_main(rank, program, driver, fault); });
  return error;
}

std::exception_ptr RankWalk::compute_main(int rank, const RankProgram& program, RankDriver& driver,
                                          const InjectedFault* fault) {
  // The communication thread is made before the compute thread's start (the step's epoch), so that
  // making it is not in the step: it waits for the go that follows that start. (Made after it, eight
  // ranks' new threads on two cores held a core for milliseconds while the first tensor-parallel
  // turns waited for their partner shards.)
  std::thread comm_thread(
      [&] { driver.on_thread(RankThread::comm, [&] { comm_main(rank, program, driver, fault); }); });
  try {
    driver.start_compute_thread();
  } catch (...) {
    collectives_.push(kStop);
    comm_thread.join();
    return std::current_exception();
  }
  collectives_.push(kGo);
  std::exception_ptr error;
  const bool raise = fault != nullptr && fault->kind == InjectedFault::Kind::raise;
  try {
    const auto& ops = program.ops;
    for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
      const Op& op = ops[i];
      if (is_collective(op.kind)) {
        collectives_.push(i);
        continue;
      }
      if (op.dep >= 0 && is_collective(ops[op.dep].kind)) {
        wait(op.dep);
        driver.waited_for(op.dep, RankThread::compute);
      }
      if (raise) throw std::runtime_error(fmt::format("{}: the injected failure (RunOptions::fault)", op_label(op)));
      driver.run_compute(i);
      done_.mark(static_cast<std::size_t>(i));
      driver.finished_compute(i);
    }
  } catch (...) {
    note_failure();
    error = std::current_exception();
    done_.fail(error);
    driver.abort(fmt::format("rank {} failed: {}", rank, error_text(error)));
  }
  collectives_.push(kStop);
  comm_thread.join();
  return error ? error : comm_error_;
}

void RankWalk::comm_main(int rank, const RankProgram& program, RankDriver& driver, const InjectedFault* fault) {
  bool stall = fault != nullptr && fault->kind == InjectedFault::Kind::stall;
  if (collectives_.pop() != kGo) return;  // the compute thread did not start
  try {
    driver.start_comm_thread();
  } catch (...) {
    note_failure();
    comm_error_ = std::current_exception();
    done_.fail(comm_error_);
  }
  for (;;) {
    const int i = collectives_.pop();
    if (i == kStop) return;
    if (comm_error_) continue;  // failed: drain the queue until the compute thread stops it
    const Op& op = program.ops[i];
    if (stall) {  // late to its first collective, as a rank stuck before it
      stall = false;
      std::this_thread::sleep_for(fault->stall);
    }
    try {
      // Collective ops wait for their producing compute op (deps point backwards, and the
      // compute thread queued this op only after reaching it in program order).
      if (op.dep >= 0) {
        wait(op.dep);
        driver.waited_for(op.dep, RankThread::comm);
      }
      driver.run_collective(i);
      done_.mark(static_cast<std::size_t>(i));
    } catch (...) {
      note_failure();
      comm_error_ = std::current_exception();
      done_.fail(comm_error_);
      driver.abort(fmt::format("rank {} failed in {}", rank, op_label(op)));
    }
  }
}

}  // namespace trainsim::runtime
