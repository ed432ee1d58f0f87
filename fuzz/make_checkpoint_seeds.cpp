// Writes the checkpoint seeds of fuzz/corpus/checkpoint/: small checkpoints as save_checkpoint
// writes them (no ranks; one rank with NaN, infinities and a negative zero; ranks of different
// sizes), and damaged copies (truncated, another version, a flipped payload byte).
//   build-fuzz/fuzz/make_checkpoint_seeds fuzz/corpus/checkpoint
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "runtime/checkpoint.h"

using trainsim::runtime::Checkpoint;
using trainsim::runtime::RankCheckpoint;

namespace {

void write(const std::string& dir, const std::string& name, const std::vector<unsigned char>& bytes) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

RankCheckpoint rank(int r, std::vector<float> w) {
  RankCheckpoint rk;
  rk.rank = r;
  rk.master_weights = w;
  for (float x : w) rk.first_moment.push_back(x * 0.5f), rk.second_moment.push_back(x * x);
  rk.optimizer_steps = 7;
  rk.scaler.scale = 65536;
  rk.scaler.good_steps = 3;
  rk.scaler.hysteresis_left = 2;
  return rk;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  using trainsim::runtime::encode_checkpoint;

  Checkpoint empty;
  write(dir, "seed-no-ranks.ckpt", encode_checkpoint(empty));

  Checkpoint one;
  one.fingerprint = "gpipe dp1 pp1 tp1 L2 h16";
  one.step = 3;
  one.data_position = 4096;
  one.seed = 1;
  const float inf = std::numeric_limits<float>::infinity();
  one.ranks.push_back(rank(0, {1.5f, -0.0f, std::nanf("1"), inf, -inf}));
  write(dir, "seed-one-rank.ckpt", encode_checkpoint(one));

  Checkpoint three = one;
  three.fingerprint = "1f1b dp1 pp3";
  three.step = 20;
  three.ranks = {rank(0, {0.25f}), rank(1, {}), rank(2, {1, 2, 3, 4})};
  three.ranks[1].scaler.scale = 0.5;
  const std::vector<unsigned char> bytes = encode_checkpoint(three);
  write(dir, "seed-three-ranks.ckpt", bytes);

  write(dir, "seed-truncated.ckpt", std::vector<unsigned char>(bytes.begin(), bytes.begin() + bytes.size() / 2));
  std::vector<unsigned char> version = bytes;
  version[6] = 2;
  write(dir, "seed-version-2.ckpt", version);
  std::vector<unsigned char> flipped = bytes;
  flipped[40] ^= 0x10;
  write(dir, "seed-flipped-byte.ckpt", flipped);
  return 0;
}
