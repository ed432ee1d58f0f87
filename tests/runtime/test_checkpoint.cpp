// Checkpoints: bitwise round trips, `latest`, and every refusal (missing, truncated,
// corrupt, other version, other plan, failed save) with a message that says why.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "runtime/checkpoint.h"

namespace trainsim::runtime {
namespace {

namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           (std::string("trainsim_ckpt_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir_, ec);
  }
  std::string dir() const { return dir_.string(); }
  fs::path dir_;
};

float float_bits(std::uint32_t bits) { return std::bit_cast<float>(bits); }

Checkpoint sample_checkpoint(int step) {
  Checkpoint c;
  c.fingerprint = "plan:gpipe p=2 d=2 m=4 | model:L4 h64 | fp16";
  c.step = step;
  c.data_position = 0x123456789ABCull + static_cast<std::uint64_t>(step);
  c.seed = 0xFEEDFACECAFEBEEFull;
  for (int r = 0; r < 3; ++r) {
    RankCheckpoint rk;
    rk.rank = r;
    for (int i = 0; i < 257; ++i) rk.master_weights.push_back(std::sin(0.37f * i + r) * 1e-3f * (i + 1));
    rk.master_weights.push_back(float_bits(0x7FC01234u));  // quiet NaN with a payload
    rk.master_weights.push_back(float_bits(0xFFA00001u));  // negative signaling-pattern NaN
    rk.master_weights.push_back(std::numeric_limits<float>::infinity());
    rk.master_weights.push_back(-std::numeric_limits<float>::infinity());
    rk.master_weights.push_back(-0.0f);
    rk.master_weights.push_back(std::numeric_limits<float>::denorm_min());
    rk.first_moment.assign(rk.master_weights.size(), 0.5f * static_cast<float>(r + 1));
    rk.second_moment.assign(rk.master_weights.size(), 1e-30f);
    if (r == 2) rk.second_moment.clear();  // empty fields round-trip too
    rk.optimizer_steps = step - r;
    rk.scaler.scale = r == 1 ? 65536.0 : 0.125;
    rk.scaler.good_steps = 17 + r;
    rk.scaler.hysteresis_left = r;
    c.ranks.push_back(rk);
  }
  return c;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void expect_bitwise_equal(const Checkpoint& a, const Checkpoint& b) {
  EXPECT_EQ(a.fingerprint, b.fingerprint);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.data_position, b.data_position);
  EXPECT_EQ(a.seed, b.seed);
  ASSERT_EQ(a.ranks.size(), b.ranks.size());
  for (std::size_t i = 0; i < a.ranks.size(); ++i) {
    EXPECT_EQ(a.ranks[i].rank, b.ranks[i].rank);
    EXPECT_TRUE(same_bits(a.ranks[i].master_weights, b.ranks[i].master_weights)) << "rank " << i;
    EXPECT_TRUE(same_bits(a.ranks[i].first_moment, b.ranks[i].first_moment)) << "rank " << i;
    EXPECT_TRUE(same_bits(a.ranks[i].second_moment, b.ranks[i].second_moment)) << "rank " << i;
    EXPECT_EQ(a.ranks[i].optimizer_steps, b.ranks[i].optimizer_steps);
    EXPECT_EQ(std::bit_cast<std::uint64_t>(a.ranks[i].scaler.scale),
              std::bit_cast<std::uint64_t>(b.ranks[i].scaler.scale));
    EXPECT_EQ(a.ranks[i].scaler, b.ranks[i].scaler);
  }
}

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `f`, expects a CheckpointError whose message holds every one of `needles`.
template <class F>
void expect_refusal(F f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected CheckpointError";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    for (const auto& n : needles) EXPECT_NE(what.find(n), std::string::npos) << "'" << n << "' not in: " << what;
  }
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::string s;
  std::getline(in, s);
  return s;
}

TEST(Crc32, StandardCheckValue) {
  const char* check = "123456789";
  EXPECT_EQ(crc32(check, 9), 0xCBF43926u);
  EXPECT_EQ(crc32("", 0), 0u);
  EXPECT_EQ(crc32("a", 1), 0xE8B7BE43u);  // independent reference value (zlib, Python binascii)
  // Continuing over a split gives the same value as one pass.
  EXPECT_EQ(crc32(check + 4, 5, crc32(check, 4)), 0xCBF43926u);
}

TEST_F(CheckpointTest, RoundTripIsBitwiseIncludingNaNAndInf) {
  Checkpoint c = sample_checkpoint(10);
  const std::string path = save_checkpoint(dir(), c);  // also creates the missing folder
  EXPECT_EQ(path, (dir_ / "step-10.ckpt").string());
  EXPECT_TRUE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  expect_bitwise_equal(load_checkpoint(path), c);
  expect_bitwise_equal(load_checkpoint(dir()), c);
  expect_bitwise_equal(load_checkpoint(dir(), c.fingerprint), c);
  // The NaN payloads really are there (not canonicalised).
  Checkpoint back = load_checkpoint(path);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(back.ranks[0].master_weights[257]), 0x7FC01234u);
  EXPECT_EQ(std::bit_cast<std::uint32_t>(back.ranks[0].master_weights[258]), 0xFFA00001u);
  EXPECT_TRUE(std::isinf(back.ranks[0].master_weights[259]));
  // Saving the same state twice gives the same bytes.
  fs::path other = dir_ / "again";
  save_checkpoint(other.string(), c);
  EXPECT_EQ(read_bytes(path), read_bytes((other / "step-10.ckpt").string()));
}

TEST_F(CheckpointTest, LatestPointsToNewestAndOlderAreKept) {
  save_checkpoint(dir(), sample_checkpoint(5));
  EXPECT_EQ(read_text(dir_ / "latest"), "step-5.ckpt");
  save_checkpoint(dir(), sample_checkpoint(10));
  EXPECT_EQ(read_text(dir_ / "latest"), "step-10.ckpt");
  EXPECT_EQ(load_checkpoint(dir()).step, 10);
  EXPECT_EQ(load_checkpoint((dir_ / "step-5.ckpt").string()).step, 5);
  EXPECT_FALSE(fs::exists(dir_ / "latest.tmp"));
}

TEST_F(CheckpointTest, MissingFileOrFolderIsRefused) {
  expect_refusal([&] { load_checkpoint((dir_ / "step-3.ckpt").string()); }, {"step-3.ckpt", "does not exist"});
  fs::create_directories(dir_);
  expect_refusal([&] { load_checkpoint(dir()); }, {"latest", "missing"});
}

TEST_F(CheckpointTest, TruncatedFileIsRefused) {
  const std::string path = save_checkpoint(dir(), sample_checkpoint(7));
  const std::vector<char> full = read_bytes(path);
  for (std::size_t keep : {std::size_t{0}, std::size_t{3}, std::size_t{10}, full.size() / 2, full.size() - 1}) {
    write_bytes(path, std::vector<char>(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(keep)));
    expect_refusal([&] { load_checkpoint(path); }, {path, "truncated"});
  }
}

TEST_F(CheckpointTest, FlippedByteIsRefusedAsCorrupt) {
  const std::string path = save_checkpoint(dir(), sample_checkpoint(7));
  const std::vector<char> full = read_bytes(path);
  // Anywhere after the header (payload or the stored checksum itself).
  for (std::size_t at : {std::size_t{16}, std::size_t{40}, full.size() / 2, full.size() - 5, full.size() - 1}) {
    std::vector<char> bad = full;
    bad[at] = static_cast<char>(bad[at] ^ 0x10);
    write_bytes(path, bad);
    expect_refusal([&] { load_checkpoint(path); }, {path, "corrupt: checksum mismatch"});
  }
  // A trailing extra byte is not silently accepted either.
  std::vector<char> longer = full;
  longer.push_back('x');
  write_bytes(path, longer);
  expect_refusal([&] { load_checkpoint(path); }, {"corrupt"});
}

TEST_F(CheckpointTest, BadMagicIsRefused) {
  const std::string path = save_checkpoint(dir(), sample_checkpoint(7));
  std::vector<char> bytes = read_bytes(path);
  bytes[0] = 'X';
  write_bytes(path, bytes);
  expect_refusal([&] { load_checkpoint(path); }, {path, "bad magic"});
}

TEST_F(CheckpointTest, OtherFormatVersionIsRefused) {
  const std::string path = save_checkpoint(dir(), sample_checkpoint(7));
  std::vector<char> bytes = read_bytes(path);
  // The version is the little-endian u16 after the 6-byte magic.
  ASSERT_EQ(static_cast<unsigned char>(bytes[6]) | (static_cast<unsigned char>(bytes[7]) << 8),
            kCheckpointFormatVersion);
  bytes[6] = static_cast<char>(kCheckpointFormatVersion + 1);
  write_bytes(path, bytes);
  expect_refusal([&] { load_checkpoint(path); },
                 {path, "format version " + std::to_string(kCheckpointFormatVersion + 1),
                  "reads version " + std::to_string(kCheckpointFormatVersion)});
}

TEST_F(CheckpointTest, FingerprintMismatchNamesBoth) {
  Checkpoint c = sample_checkpoint(4);
  save_checkpoint(dir(), c);
  const std::string expected = "plan:1f1b p=2 d=2 m=4 | model:L4 h64 | fp16";
  expect_refusal([&] { load_checkpoint(dir(), expected); },
                 {"fingerprint mismatch", c.fingerprint, expected, "character 5"});
}

TEST_F(CheckpointTest, FailedSaveThrowsAndKeepsThePreviousCheckpoint) {
  Checkpoint first = sample_checkpoint(1);
  save_checkpoint(dir(), first);
  // Block the temporary file's path with a folder: the write fails even for root.
  fs::create_directories(dir_ / "step-2.ckpt.tmp" / "x");
  expect_refusal([&] { save_checkpoint(dir(), sample_checkpoint(2)); }, {"cannot save", "step-2.ckpt.tmp"});
  EXPECT_FALSE(fs::exists(dir_ / "step-2.ckpt"));
  EXPECT_EQ(read_text(dir_ / "latest"), "step-1.ckpt");
  expect_bitwise_equal(load_checkpoint(dir()), first);

  // The checkpoint itself written, but `latest` cannot be replaced: latest still names the
  // previous, complete checkpoint.
  fs::create_directories(dir_ / "latest.tmp" / "x");
  expect_refusal([&] { save_checkpoint(dir(), sample_checkpoint(3)); }, {"latest.tmp"});
  expect_bitwise_equal(load_checkpoint(dir()), first);
  fs::remove_all(dir_ / "latest.tmp");
  fs::remove_all(dir_ / "step-2.ckpt.tmp");
  EXPECT_EQ(load_checkpoint(save_checkpoint(dir(), sample_checkpoint(2))).step, 2);
}

TEST_F(CheckpointTest, UnwritableFolderThrows) {
  // A path below a regular file cannot become a folder.
  fs::create_directories(dir_);
  { std::ofstream(dir_ / "file") << "not a folder"; }
  expect_refusal([&] { save_checkpoint((dir_ / "file" / "ckpt").string(), sample_checkpoint(1)); },
                 {"cannot save", "file/ckpt"});
  expect_refusal([&] { save_checkpoint((dir_ / "file").string(), sample_checkpoint(1)); }, {"not a folder"});
}

TEST_F(CheckpointTest, ReadOnlyFolderThrowsAndKeepsThePreviousCheckpoint) {
  const fs::path ro = dir_ / "readonly";
  Checkpoint first = sample_checkpoint(1);
  save_checkpoint(ro.string(), first);
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: folder permissions do not stop writes";
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec, fs::perm_options::replace);
  expect_refusal([&] { save_checkpoint(ro.string(), sample_checkpoint(2)); }, {"cannot save", "Permission denied"});
  fs::permissions(ro, fs::perms::owner_all, fs::perm_options::replace);
  expect_bitwise_equal(load_checkpoint(ro.string()), first);
}

// encode_checkpoint / decode_checkpoint are the file's bytes without the disk (what the fuzz
// target fuzz/fuzz_checkpoint.cpp reads): the same bytes save_checkpoint writes, the same
// refusals load_checkpoint gives, with the name given standing for the file.
TEST_F(CheckpointTest, InMemoryEncodingIsTheFileFormat) {
  const Checkpoint c = sample_checkpoint(9);
  const std::vector<unsigned char> bytes = encode_checkpoint(c);
  const std::vector<char> file = read_bytes(save_checkpoint(dir(), c));
  ASSERT_EQ(bytes.size(), file.size());
  EXPECT_EQ(std::memcmp(bytes.data(), file.data(), bytes.size()), 0);
  expect_bitwise_equal(decode_checkpoint(bytes, "mem.ckpt"), c);
  std::vector<unsigned char> bad = bytes;
  bad[bad.size() / 2] ^= 0x01;
  expect_refusal([&] { decode_checkpoint(bad, "mem.ckpt"); }, {"mem.ckpt", "checksum mismatch"});
  expect_refusal([&] { decode_checkpoint({}, "mem.ckpt"); }, {"mem.ckpt", "truncated"});
}

}  // namespace
}  // namespace trainsim::runtime
