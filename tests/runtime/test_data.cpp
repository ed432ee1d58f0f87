// Training data: seed-determined order, every window once per epoch, targets shifted by
// one, batches independent of how they are split, the bundled corpus, clear errors, and a
// synthetic stream that is deterministic and learnable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/data/dataset.h"

namespace trainsim::runtime {
namespace {

namespace fs = std::filesystem;

// A global batch as a list of rows (each row the tokens of one sample), in sample order,
// gathered from the micro-batches of every replica under a given split.
std::vector<std::vector<std::int32_t>> global_batch(const Dataset& d, std::uint64_t position, int global,
                                                    int dp, int mbs) {
  const int per_replica_mbs = global / (dp * mbs);
  std::vector<std::vector<std::int32_t>> rows(static_cast<std::size_t>(global));
  for (int m = 0; m < per_replica_mbs; ++m)
    for (int r = 0; r < dp; ++r) {
      MicroBatchTokens mb = d.microbatch(position, r, m, dp, mbs);
      EXPECT_EQ(mb.batch, mbs);
      EXPECT_EQ(mb.seq_length, d.seq_length());
      for (int row = 0; row < mbs; ++row) {
        // The header's mapping: sample i -> replica (i / mbs) % dp, micro-batch i / (mbs * dp).
        const int i = m * mbs * dp + r * mbs + row;
        EXPECT_EQ((i / mbs) % dp, r);
        EXPECT_EQ(i / (mbs * dp), m);
        auto begin = mb.tokens.begin() + static_cast<std::ptrdiff_t>(row) * mb.seq_length;
        rows[static_cast<std::size_t>(i)].assign(begin, begin + mb.seq_length);
      }
    }
  return rows;
}

std::vector<std::size_t> epoch_order(const Dataset& d, std::uint64_t epoch) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < d.num_samples(); ++i) order.push_back(d.window_for(epoch * d.num_samples() + i));
  return order;
}

TEST(Data, BundledCorpusIsReadableAscii) {
  Dataset d = Dataset::from_file(bundled_corpus_path(), 64, 1);
  EXPECT_EQ(d.vocab_size(), 256);
  EXPECT_EQ(d.source(), bundled_corpus_path());
  EXPECT_GT(d.num_tokens(), 150'000u);
  EXPECT_LT(d.num_tokens(), 260'000u);
  EXPECT_EQ(d.num_samples(), (d.num_tokens() - 1) / 64);
  const std::string start = "First Citizen:";
  for (std::size_t i = 0; i < start.size(); ++i) EXPECT_EQ(d.tokens()[i], start[i]);
  for (std::int32_t t : d.tokens()) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, 128) << "the corpus is plain ASCII";
  }
  EXPECT_EQ(d.tokens().back(), '\n') << "the corpus is cut at a line boundary";
}

TEST(Data, SameSeedSameOrderDifferentSeedDifferentOrder) {
  const std::string path = bundled_corpus_path();
  Dataset a = Dataset::from_file(path, 32, 7), b = Dataset::from_file(path, 32, 7);
  Dataset c = Dataset::from_file(path, 32, 8);
  EXPECT_EQ(epoch_order(a, 0), epoch_order(b, 0));
  EXPECT_NE(epoch_order(a, 0), epoch_order(c, 0));
  MicroBatchTokens x = a.microbatch(100, 1, 2, 2, 3), y = b.microbatch(100, 1, 2, 2, 3);
  EXPECT_EQ(x.tokens, y.tokens);
  EXPECT_EQ(x.targets, y.targets);
  EXPECT_NE(x.tokens, c.microbatch(100, 1, 2, 2, 3).tokens);
}

TEST(Data, EveryWindowOnceEachEpochAndEpochsReshuffle) {
  Dataset d = Dataset::from_file(bundled_corpus_path(), 50, 3);
  const std::size_t n = d.num_samples();
  ASSERT_GT(n, 1000u);
  std::vector<std::size_t> e0 = epoch_order(d, 0), e1 = epoch_order(d, 1);
  for (const auto* order : {&e0, &e1}) {
    std::vector<std::size_t> sorted = *order;
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i) << "window " << i << " not visited exactly once";
  }
  EXPECT_NE(e0, e1) << "each epoch is reshuffled";
  // Shuffled, not the identity: few windows keep their place.
  std::size_t fixed = 0;
  for (std::size_t i = 0; i < n; ++i) fixed += e0[i] == i;
  EXPECT_LT(fixed, n / 20);
}

TEST(Data, PermutationHoldsForSmallAndOddSizes) {
  for (std::size_t bytes : {2u, 3u, 5u, 17u, 64u, 65u, 1000u, 4097u}) {
    Dataset d = Dataset::synthetic(16, bytes, 1, 11);
    ASSERT_EQ(d.num_samples(), bytes - 1);
    std::vector<std::size_t> order = epoch_order(d, 2);
    std::sort(order.begin(), order.end());
    for (std::size_t i = 0; i < order.size(); ++i) ASSERT_EQ(order[i], i) << "n = " << bytes - 1;
  }
}

TEST(Data, TargetsAreTokensShiftedByOne) {
  Dataset d = Dataset::from_file(bundled_corpus_path(), 16, 5);
  for (int m = 0; m < 3; ++m) {
    MicroBatchTokens mb = d.microbatch(40, 0, m, 1, 4);
    ASSERT_EQ(mb.tokens.size(), 4u * 16);
    ASSERT_EQ(mb.targets.size(), 4u * 16);
    for (int row = 0; row < 4; ++row) {
      // The row is the corpus window the order names.
      const std::size_t start = d.window_start(d.window_for(40 + static_cast<std::uint64_t>(m) * 4 + row));
      for (int t = 0; t < 16; ++t) {
        const std::size_t k = static_cast<std::size_t>(row) * 16 + t;
        EXPECT_EQ(mb.tokens[k], d.tokens()[start + t]);
        EXPECT_EQ(mb.targets[k], d.tokens()[start + t + 1]);
        if (t + 1 < 16) {
          EXPECT_EQ(mb.targets[k], mb.tokens[k + 1]);
        }
      }
    }
  }
}

TEST(Data, GlobalBatchDoesNotDependOnTheSplit) {
  Dataset d = Dataset::from_file(bundled_corpus_path(), 24, 9);
  for (std::uint64_t position : {0ull, 8ull, 8000ull}) {
    auto a = global_batch(d, position, 8, 2, 2);
    auto b = global_batch(d, position, 8, 1, 4);
    auto c = global_batch(d, position, 8, 4, 1);
    auto e = global_batch(d, position, 8, 1, 8);
    EXPECT_EQ(a, b);  // same samples, and the same sample index in each split
    EXPECT_EQ(a, c);
    EXPECT_EQ(a, e);
    // The set (order-free) is what the gradient depends on.
    std::multiset<std::vector<std::int32_t>> sa(a.begin(), a.end()), sc(c.begin(), c.end());
    EXPECT_EQ(sa, sc);
  }
  // Consecutive steps read consecutive, disjoint sample ranges.
  auto s0 = global_batch(d, 0, 8, 2, 2), s1 = global_batch(d, 8, 8, 2, 2);
  for (const auto& row : s1) EXPECT_EQ(std::count(s0.begin(), s0.end(), row), 0);
}

TEST(Data, MissingFileNamesThePath) {
  const std::string path = "/nonexistent/trainsim/corpus.txt";
  try {
    (void)Dataset::from_file(path, 8, 1);
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find("No such file"), std::string::npos) << what;
  }
}

TEST(Data, TooShortFileIsRefused) {
  const fs::path path = fs::temp_directory_path() / "trainsim_test_data_short.txt";
  { std::ofstream(path) << "abcdefgh"; }  // 8 bytes: one sample of seq 7, none of seq 8
  EXPECT_EQ(Dataset::from_file(path.string(), 7, 1).num_samples(), 1u);
  try {
    (void)Dataset::from_file(path.string(), 8, 1);
    FAIL() << "expected std::runtime_error";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path.string()), std::string::npos) << what;
    EXPECT_NE(what.find("shorter than one sample"), std::string::npos) << what;
  }
  fs::remove(path);
}

TEST(Data, BadSplitArgumentsAreRefused) {
  Dataset d = Dataset::synthetic(32, 1000, 8, 1);
  EXPECT_THROW((void)d.microbatch(0, 2, 0, 2, 1), std::invalid_argument);
  EXPECT_THROW((void)d.microbatch(0, 0, 0, 0, 1), std::invalid_argument);
  EXPECT_THROW((void)d.microbatch(0, 0, -1, 1, 1), std::invalid_argument);
  EXPECT_THROW((void)d.microbatch(0, 0, 0, 1, 0), std::invalid_argument);
}

// Empirical conditional entropy H(next | previous two) in nats.
double conditional_entropy(const std::vector<std::int32_t>& t, int order) {
  std::map<std::vector<std::int32_t>, std::map<std::int32_t, double>> counts;
  for (std::size_t i = static_cast<std::size_t>(order); i < t.size(); ++i)
    counts[std::vector<std::int32_t>(t.begin() + static_cast<std::ptrdiff_t>(i) - order,
                                     t.begin() + static_cast<std::ptrdiff_t>(i))][t[i]] += 1;
  double total = static_cast<double>(t.size() - static_cast<std::size_t>(order)), h = 0;
  for (const auto& [ctx, next] : counts) {
    double n = 0;
    for (const auto& [tok, c] : next) n += c;
    for (const auto& [tok, c] : next) h -= c / total * std::log(c / n);
  }
  return h;
}

TEST(Data, SyntheticChainIsDeterministicAndLearnable) {
  const int vocab = 64;
  Dataset a = Dataset::synthetic(vocab, 400'000, 32, 42), b = Dataset::synthetic(vocab, 400'000, 32, 42);
  Dataset c = Dataset::synthetic(vocab, 400'000, 32, 43);
  EXPECT_EQ(a.tokens(), b.tokens());
  EXPECT_NE(a.tokens(), c.tokens());
  // The last stream made is kept: asked for again after another one, the first is the same, and
  // a shorter stream of the same chain is the longer one's beginning, at its own length.
  EXPECT_EQ(Dataset::synthetic(vocab, 400'000, 32, 42).tokens(), a.tokens());
  const Dataset shorter = Dataset::synthetic(vocab, 1000, 32, 42);
  ASSERT_EQ(shorter.num_tokens(), 1000u);
  EXPECT_TRUE(std::equal(shorter.tokens().begin(), shorter.tokens().end(), a.tokens().begin()));
  EXPECT_EQ(a.vocab_size(), vocab);
  EXPECT_EQ(a.num_samples(), (400'000u - 1) / 32);
  for (std::int32_t t : a.tokens()) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, vocab);
  }
  // Uses much of the vocabulary, yet each context allows only a few next tokens.
  std::set<std::int32_t> used(a.tokens().begin(), a.tokens().end());
  EXPECT_GT(used.size(), static_cast<std::size_t>(vocab / 2));
  const double h0 = conditional_entropy(a.tokens(), 0);
  const double h2 = conditional_entropy(a.tokens(), 2);
  // With weights 10:6:3:1 over four successors, H = 1.14 nats; log 64 = 4.16.
  EXPECT_LT(h2, 0.4 * std::log(vocab));
  EXPECT_NEAR(h2, 1.14, 0.15);
  EXPECT_GT(h0, h2 + 1.0) << "the context carries information a model can learn";
  std::map<std::pair<int, int>, std::set<int>> successors;
  for (std::size_t i = 2; i < a.tokens().size(); ++i)
    successors[{a.tokens()[i - 2], a.tokens()[i - 1]}].insert(a.tokens()[i]);
  for (const auto& [ctx, next] : successors) ASSERT_LE(next.size(), 4u);
}

TEST(Data, SyntheticByteVocabularyIsWellBelowUniform) {
  Dataset d = Dataset::synthetic(256, 1'000'000, 64, 1);
  const double h2 = conditional_entropy(d.tokens(), 2);
  // Finite samples underestimate entropy, never push it to log 256 = 5.55.
  EXPECT_LT(h2, 0.3 * std::log(256.0));
  EXPECT_GT(h2, 0.5) << "not a deterministic sequence";
  EXPECT_LT(conditional_entropy(d.tokens(), 0), std::log(256.0) - 0.1) << "unigrams are skewed too";
  EXPECT_THROW((void)Dataset::synthetic(3, 1000, 8, 1), std::runtime_error);
  EXPECT_THROW((void)Dataset::synthetic(256, 8, 8, 1), std::runtime_error);
}

}  // namespace
}  // namespace trainsim::runtime
