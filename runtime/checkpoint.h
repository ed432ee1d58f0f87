// Checkpoints: everything needed to continue a run bit for bit on the CPU backend: master
// weights and optimizer moments of every rank, loss-scaler state, the data position and
// RNG seed, the step. Written atomically (a temporary file, flushed, then renamed), with a
// checksum over the content and a fingerprint of the plan it belongs to, so a corrupt or
// mismatched file is refused with a clear error and the last good checkpoint is never
// overwritten by a half-written one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
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
// Creates `dir` if missing and keeps older checkpoints. On failure (the folder cannot be
// created or written, the disk is full) throws CheckpointError; `dir`/latest and the
// checkpoints already there are left as they were.
std::string save_checkpoint(const std::string& dir, const Checkpoint& ckpt);
// Reads `path`, or the latest in `path` when it is a folder. Throws CheckpointError when the
// file is missing, truncated, corrupt (checksum) or from another format version, and when
// `expected_fingerprint` (if not empty) differs, saying what differs.
Checkpoint load_checkpoint(const std::string& path, const std::string& expected_fingerprint = "");

// The file's bytes, without touching the disk (save_checkpoint writes these; the fuzz target
// fuzz/fuzz_checkpoint.cpp reads them). decode_checkpoint refuses what load_checkpoint
// refuses, with the same CheckpointError; `name` stands for the file in its messages.
std::vector<unsigned char> encode_checkpoint(const Checkpoint& ckpt);
Checkpoint decode_checkpoint(const std::vector<unsigned char>& bytes, const std::string& name);

// The file format (all integers little-endian):
//   "TSCKPT"  u16 format version  u64 payload length  payload  u32 CRC-32 of all bytes before it
// The payload is a sequence of fields, each a u64 length followed by that many bytes:
//   fingerprint, step (i64), data_position (u64), seed (u64), rank count (u64), then per rank:
//   rank (i64), master_weights, first_moment, second_moment (f32 bit patterns),
//   optimizer_steps (i64), scaler scale (f64 bits), good_steps (i64), hysteresis_left (i64).
inline constexpr std::uint16_t kCheckpointFormatVersion = 1;

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, as in zlib and PNG). Pass the result of
// one call as `crc` to continue over more bytes. crc32("123456789") == 0xCBF43926.
std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t crc = 0);

}  // namespace trainsim::runtime
