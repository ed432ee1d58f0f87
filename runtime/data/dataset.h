// Training data for the runtime: byte-level tokens (vocabulary 256) read from a text file,
// or a synthetic generator. Samples are windows of seq_length + 1 tokens; the order in
// which windows are visited is a permutation fixed by the seed (reshuffled each epoch), and
// the data position (samples consumed so far) is all a checkpoint needs to continue it.
//
// A global batch of step t is samples [position, position + global_batch_size); sample i of
// it goes to replica (i / micro_batch_size) % dp, micro-batch i / (micro_batch_size * dp),
// so the samples of a step do not depend on how the batch is split.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainsim::runtime {

struct MicroBatchTokens {
  int batch = 0, seq_length = 0;
  std::vector<std::int32_t> tokens;   // batch * seq_length, row-major
  std::vector<std::int32_t> targets;  // the next token of each position
};

class Dataset {
 public:
  // Reads the whole file; throws std::runtime_error naming the file if it cannot be read or
  // is shorter than one sample.
  static Dataset from_file(const std::string& path, int seq_length, std::uint64_t seed);
  // A learnable synthetic stream (a fixed random order-2 Markov chain over `vocab_size`
  // tokens drawn from the seed), `num_tokens` long.
  static Dataset synthetic(int vocab_size, std::size_t num_tokens, int seq_length, std::uint64_t seed);

  int vocab_size() const { return vocab_size_; }
  std::size_t num_samples() const;  // windows per epoch
  const std::string& source() const { return source_; }

  // Micro-batch `microbatch` of `replica` for the global batch starting at `position`.
  MicroBatchTokens microbatch(std::uint64_t position, int replica, int microbatch, int dp,
                              int micro_batch_size) const;

 private:
  std::vector<std::int32_t> window_start_for(std::uint64_t sample) const;
  std::string source_;
  int vocab_size_ = 256;
  int seq_length_ = 0;
  std::uint64_t seed_ = 0;
  std::vector<std::uint8_t> bytes_;    // file contents (byte tokens)
  std::vector<std::int32_t> tokens_;   // synthetic tokens
};

// Where the bundled corpus lives (runtime/data/), for defaults and tests.
std::string bundled_corpus_path();

}  // namespace trainsim::runtime
