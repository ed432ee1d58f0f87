// Checkpoints: everything needed to continue a run bit for bit on the CPU backend: master
// weights and optimizer moments of every rank, loss-scaler state, the data position and
// RNG seed, the step. Written atomically (a temporary file, flushed, then renamed), with a
// checksum over the content and a fingerprint of the plan it belongs to, so a corrupt or
// mismatched file is refused with a clear error and the last good checkpoint is never
// overwritten by a half-written one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/numerics/loss_scaler.h"

namespace trainsim::runtime {

struct RankCheckpoint {
  int rank = 0;
  std::vector<float> master_weights;
  std::vector<float> first_moment, second_moment;
  std::int64_t optimizer_steps = 0;
  LossScaler::State scaler;  // each rank keeps its own scaler (they differ under local checks)
};

struct Checkpoint {
  std::string fingerprint;  // the plan and model this belongs to; must match to resume
  int step = 0;             // optimizer steps completed
  std::uint64_t data_position = 0;
  std::uint64_t seed = 0;
  std::vector<RankCheckpoint> ranks;
};

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Writes `dir`/step-<step>.ckpt atomically and points `dir`/latest at it; returns the path.
std::string save_checkpoint(const std::string& dir, const Checkpoint& ckpt);
// Reads `path`, or the latest in `path` when it is a folder. Throws CheckpointError when the
// file is missing, truncated, corrupt (checksum) or from another format version, and when
// `expected_fingerprint` (if not empty) differs, saying what differs.
Checkpoint load_checkpoint(const std::string& path, const std::string& expected_fingerprint = "");

}  // namespace trainsim::runtime
