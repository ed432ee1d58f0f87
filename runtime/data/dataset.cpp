// Training data: byte tokens of a file or a synthetic order-2 Markov stream, visited in a
// seed-determined order. Every random choice here comes from splitmix64 and integer
// arithmetic, so the same seed gives the same tokens and the same order on every platform
// and standard library.
#include "runtime/data/dataset.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "runtime/numerics/splitmix64.h"

namespace trainsim::runtime {
namespace {

// splitmix64's output for counter value x: the finaliser of x one gamma on.
constexpr std::uint64_t mix64(std::uint64_t x) { return splitmix64_mix(x + kSplitMixGamma); }

// A keyed permutation of [0, n): a balanced 4-round Feistel network on the smallest even
// number of bits covering n, with cycle walking for values >= n. Stateless, so ranks on
// different threads can ask for any sample without sharing a shuffled vector.
class FeistelPermutation {
 public:
  FeistelPermutation(std::uint64_t n, std::uint64_t key) : n_(n) {
    while ((std::uint64_t{1} << (2 * half_bits_)) < n_) ++half_bits_;
    mask_ = (std::uint64_t{1} << half_bits_) - 1;
    for (int r = 0; r < kRounds; ++r) keys_[r] = mix64(key + 0x632BE59BD9B4E019ull * (r + 1));
  }
  std::uint64_t operator()(std::uint64_t x) const {
    do x = encrypt(x);
    while (x >= n_);  // terminates: x's cycle in the larger domain comes back below n
    return x;
  }

 private:
  static constexpr int kRounds = 4;
  std::uint64_t encrypt(std::uint64_t x) const {
    std::uint64_t left = x >> half_bits_, right = x & mask_;
    for (int r = 0; r < kRounds; ++r) {
      std::uint64_t next = left ^ (mix64(right ^ keys_[r]) & mask_);
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }
  std::uint64_t n_;
  int half_bits_ = 1;
  std::uint64_t mask_ = 1;
  std::uint64_t keys_[kRounds] = {};
};

// The synthetic chain: after (a, b) the next token is one of four candidates with weights
// 10:6:3:1 (out of 20). The first candidate depends on b alone (a bigram a model picks up
// early), the other three on the pair (a, b); all four are distinct. Candidates come from
// hashing (seed, a, b), so no table of vocab_size^2 entries is stored.
constexpr int kCandidates = 4;
constexpr std::uint32_t kWeights[kCandidates] = {10, 6, 3, 1};
constexpr std::uint32_t kWeightTotal = 20;

void chain_candidates(std::uint64_t chain_key, std::uint32_t vocab, std::int32_t a, std::int32_t b,
                      std::int32_t out[kCandidates]) {
  auto ua = static_cast<std::uint64_t>(a), ub = static_cast<std::uint64_t>(b);
  out[0] = static_cast<std::int32_t>(mix64(chain_key ^ mix64(ub + 1)) % vocab);
  std::uint64_t h = mix64(chain_key ^ mix64((ua << 32 | ub) + 0x5851F42D4C957F2Dull));
  for (int j = 1; j < kCandidates; ++j) {
    for (;;) {
      h = mix64(h);
      auto c = static_cast<std::int32_t>(h % vocab);
      bool fresh = true;
      for (int k = 0; k < j; ++k) fresh = fresh && out[k] != c;
      if (fresh) {
        out[j] = c;
        break;
      }
    }
  }
}

std::vector<std::int32_t> make_synthetic_stream(int vocab_size, std::size_t num_tokens, std::uint64_t seed) {
  const auto vocab = static_cast<std::uint32_t>(vocab_size);
  const std::uint64_t chain_key = mix64(seed ^ 0xC0FFEE5EED5EED00ull);
  SplitMix64 rng(mix64(seed) ^ 0x7A11B0A75EEDull);
  std::vector<std::int32_t> tokens(num_tokens);
  tokens[0] = static_cast<std::int32_t>(rng.below(vocab));
  if (num_tokens > 1) tokens[1] = static_cast<std::int32_t>(rng.below(vocab));
  std::int32_t cand[kCandidates];
  for (std::size_t i = 2; i < num_tokens; ++i) {
    chain_candidates(chain_key, vocab, tokens[i - 2], tokens[i - 1], cand);
    std::uint32_t r = rng.below(kWeightTotal);
    int j = 0;
    while (r >= kWeights[j]) r -= kWeights[j++];
    tokens[i] = cand[j];
  }
  return tokens;
}

// The stream is a function of its three arguments alone, and a run makes 2^20 tokens (~50 ms)
// whatever it reads, more than a small plan's whole run: the last stream made is kept, for the
// runs of one process that ask for the same one (a test's matrix of layouts, `prove`'s two runs,
// a validation's attempts). A copy is handed out; the tokens are the same either way.
std::vector<std::int32_t> synthetic_stream(int vocab_size, std::size_t num_tokens, std::uint64_t seed) {
  struct Kept {
    int vocab_size = 0;
    std::size_t num_tokens = 0;
    std::uint64_t seed = 0;
    std::vector<std::int32_t> tokens;
  };
  static std::mutex mu;
  static Kept kept;
  std::lock_guard lock(mu);
  if (kept.tokens.empty() || kept.vocab_size != vocab_size || kept.num_tokens != num_tokens || kept.seed != seed)
    kept = Kept{vocab_size, num_tokens, seed, make_synthetic_stream(vocab_size, num_tokens, seed)};
  return kept.tokens;
}

std::string describe_errno(int err) { return err == 0 ? std::string("read error") : std::strerror(err); }

}  // namespace

Dataset::Dataset(std::string source, int vocab_size, int seq_length, std::uint64_t seed,
                 std::vector<std::int32_t> tokens)
    : source_(std::move(source)), vocab_size_(vocab_size), seq_length_(seq_length), seed_(seed),
      tokens_(std::move(tokens)) {}

Dataset Dataset::from_file(const std::string& path, int seq_length, std::uint64_t seed) {
  if (seq_length < 1)
    throw std::runtime_error("dataset '" + path + "': seq_length must be at least 1, got " +
                             std::to_string(seq_length));
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw std::runtime_error("dataset '" + path + "': cannot open file: " + describe_errno(errno) +
                             " (set runtime.data.path to a readable text file, or use "
                             "runtime.data.synthetic: true)");
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad())
    throw std::runtime_error("dataset '" + path + "': read failed: " + describe_errno(errno));
  const std::size_t need = static_cast<std::size_t>(seq_length) + 1;
  if (raw.size() < need)
    throw std::runtime_error("dataset '" + path + "': file is " + std::to_string(raw.size()) +
                             " bytes, shorter than one sample of seq_length + 1 = " +
                             std::to_string(need) + " bytes");
  std::vector<std::int32_t> tokens(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i)
    tokens[i] = static_cast<std::int32_t>(static_cast<unsigned char>(raw[i]));
  return Dataset(path, 256, seq_length, seed, std::move(tokens));
}

Dataset Dataset::synthetic(int vocab_size, std::size_t num_tokens, int seq_length, std::uint64_t seed) {
  if (vocab_size < kCandidates)
    throw std::runtime_error("synthetic dataset: vocab_size must be at least " +
                             std::to_string(kCandidates) + ", got " + std::to_string(vocab_size));
  if (seq_length < 1)
    throw std::runtime_error("synthetic dataset: seq_length must be at least 1, got " +
                             std::to_string(seq_length));
  if (num_tokens < static_cast<std::size_t>(seq_length) + 1)
    throw std::runtime_error("synthetic dataset: num_tokens (" + std::to_string(num_tokens) +
                             ") is shorter than one sample of seq_length + 1 = " +
                             std::to_string(seq_length + 1));
  std::string source = "synthetic(order-2 Markov, vocab_size=" + std::to_string(vocab_size) +
                       ", num_tokens=" + std::to_string(num_tokens) + ", seed=" + std::to_string(seed) + ")";
  return Dataset(std::move(source), vocab_size, seq_length, seed, synthetic_stream(vocab_size, num_tokens, seed));
}

std::size_t Dataset::num_samples() const {
  if (seq_length_ < 1 || tokens_.size() < 2) return 0;
  return (tokens_.size() - 1) / static_cast<std::size_t>(seq_length_);
}

std::size_t Dataset::window_for(std::uint64_t sample) const {
  const std::uint64_t n = num_samples();
  if (n == 0) throw std::logic_error("dataset '" + source_ + "' has no samples");
  const std::uint64_t epoch = sample / n, index = sample % n;
  const FeistelPermutation perm(n, mix64(seed_ ^ 0xDA7A5EEDull) ^ mix64(epoch + 1));
  return static_cast<std::size_t>(perm(index));
}

MicroBatchTokens Dataset::microbatch(std::uint64_t position, int replica, int microbatch, int dp,
                                     int micro_batch_size) const {
  if (dp < 1 || micro_batch_size < 1)
    throw std::invalid_argument("dataset: data_parallel_size (" + std::to_string(dp) +
                                ") and micro_batch_size (" + std::to_string(micro_batch_size) +
                                ") must be at least 1");
  if (replica < 0 || replica >= dp || microbatch < 0)
    throw std::invalid_argument("dataset: replica " + std::to_string(replica) + " / micro-batch " +
                                std::to_string(microbatch) + " out of range for data_parallel_size " +
                                std::to_string(dp));
  MicroBatchTokens mb;
  mb.batch = micro_batch_size;
  mb.seq_length = seq_length_;
  const auto seq = static_cast<std::size_t>(seq_length_);
  mb.tokens.resize(static_cast<std::size_t>(micro_batch_size) * seq);
  mb.targets.resize(mb.tokens.size());
  // Sample i of the global batch goes to replica (i / mbs) % dp, micro-batch i / (mbs * dp).
  const std::uint64_t first = static_cast<std::uint64_t>(microbatch) * micro_batch_size * dp +
                              static_cast<std::uint64_t>(replica) * micro_batch_size;
  for (int row = 0; row < micro_batch_size; ++row) {
    const std::size_t start = window_start(window_for(position + first + row));
    const std::int32_t* src = tokens_.data() + start;
    std::int32_t* tok = mb.tokens.data() + static_cast<std::size_t>(row) * seq;
    std::int32_t* tgt = mb.targets.data() + static_cast<std::size_t>(row) * seq;
    for (std::size_t t = 0; t < seq; ++t) {
      tok[t] = src[t];
      tgt[t] = src[t + 1];
    }
  }
  return mb;
}

std::string bundled_corpus_path() { return TRAINSIM_SOURCE_DIR "/runtime/data/shakespeare.txt"; }

}  // namespace trainsim::runtime
