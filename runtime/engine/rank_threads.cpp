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

std::exception_ptr RankWalk::run(int rank, const RankProgram& program, RankDriver& driver) {
  comm_error_ = nullptr;
  std::exception_ptr error;
  driver.on_thread(RankThread::compute, [&] { error = compute_main(rank, program, driver); });
  return error;
}

std::exception_ptr RankWalk::compute_main(int rank, const RankProgram& program, RankDriver& driver) {
  try {
    driver.start_compute_thread();
  } catch (...) {
    return std::current_exception();
  }
  std::exception_ptr error;
  std::thread comm_thread(
      [&] { driver.on_thread(RankThread::comm, [&] { comm_main(rank, program, driver); }); });
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
      driver.run_compute(i);
      done_.mark(static_cast<std::size_t>(i));
      driver.finished_compute(i);
    }
  } catch (...) {
    error = std::current_exception();
    done_.fail(error);
    driver.abort(fmt::format("rank {} failed: {}", rank, error_text(error)));
  }
  collectives_.push(-1);
  comm_thread.join();
  return error ? error : comm_error_;
}

void RankWalk::comm_main(int rank, const RankProgram& program, RankDriver& driver) {
  try {
    driver.start_comm_thread();
  } catch (...) {
    comm_error_ = std::current_exception();
    done_.fail(comm_error_);
  }
  for (;;) {
    const int i = collectives_.pop();
    if (i < 0) return;
    if (comm_error_) continue;  // failed: drain the queue until the compute thread stops it
    const Op& op = program.ops[i];
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
      comm_error_ = std::current_exception();
      done_.fail(comm_error_);
      driver.abort(fmt::format("rank {} failed in {}", rank, op_label(op)));
    }
  }
}

}  // namespace trainsim::runtime
