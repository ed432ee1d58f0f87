// Training data for the runtime: byte-level tokens (vocabulary 256) read from a text file,
// or a synthetic generator. Samples are windows of seq_length + 1 tokens; the order in
// which windows are visited is a permutation fixed by the seed (reshuffled each epoch), and
// the data position (samples consumed so far) is all a checkpoint needs to continue it.
//
// A global batch of step t is samples [position, position + global_batch_size); sample i of
// it goes to replica (i / micro_batch_size) % dp, micro-batch i / (micro_batch_size * dp),
// so the samples of a step do not depend on how the batch is split.
#pragma once

#include <cstddef>
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

  int seq_length() const { return seq_length_; }
  std::size_t num_tokens() const { return tokens_.size(); }
  const std::vector<std::int32_t>& tokens() const { return tokens_; }  // the whole stream

  // Micro-batch `microbatch` of `replica` for the global batch starting at `position`.
  // Throws std::invalid_argument when dp or micro_batch_size < 1, or replica / microbatch
  // are out of range.
  MicroBatchTokens microbatch(std::uint64_t position, int replica, int microbatch, int dp,
                              int micro_batch_size) const;

  // The window (index into [0, num_samples())) that global sample `sample` reads: epoch
  // sample / num_samples() visits every window once, in an order fixed by (seed, epoch).
  std::size_t window_for(std::uint64_t sample) const;
  // First token of window w (windows are non-overlapping strides of seq_length).
  std::size_t window_start(std::size_t w) const { return w * static_cast<std::size_t>(seq_length_); }

 private:
  Dataset(std::string source, int vocab_size, int seq_length, std::uint64_t seed,
          std::vector<std::int32_t> tokens);
  std::string source_;
  int vocab_size_ = 256;
  int seq_length_ = 0;
  std::uint64_t seed_ = 0;
  std::vector<std::int32_t> tokens_;   // byte tokens of the file, or the synthetic stream
};

// Where the bundled corpus lives (runtime/data/), for defaults and tests.
std::string bundled_corpus_path();

}  // namespace trainsim::runtime
