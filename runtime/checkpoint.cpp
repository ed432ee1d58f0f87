// Checkpoint files: a self-describing, checksummed binary format written atomically
// (temporary file, fsync, rename, fsync of the folder), so a crash or a full disk never
// leaves `latest` pointing at a half-written file.
#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <system_error>

namespace trainsim::runtime {
namespace fs = std::filesystem;

namespace {

constexpr char kMagic[6] = {'T', 'S', 'C', 'K', 'P', 'T'};
constexpr std::size_t kHeaderBytes = sizeof kMagic + 2 + 8;  // magic, version, payload length
constexpr std::size_t kTrailerBytes = 4;                      // CRC-32

constexpr std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
    table[i] = c;
  }
  return table;
}
constexpr std::array<std::uint32_t, 256> kCrcTable = make_crc_table();

// ---- encoding -------------------------------------------------------------------------

class Writer {
 public:
  void raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  void u16(std::uint16_t v) {
    for (int i = 0; i < 2; ++i) out_.push_back(static_cast<unsigned char>(v >> (8 * i)));
  }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<unsigned char>(v >> (8 * i)));
  }
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<unsigned char>(v >> (8 * i)));
  }
  // Length-prefixed fields.
  void field_u64(std::uint64_t v) {
    u64(8);
    u64(v);
  }
  void field_i64(std::int64_t v) { field_u64(static_cast<std::uint64_t>(v)); }
  void field_string(const std::string& s) {
    u64(s.size());
    raw(s.data(), s.size());
  }
  void field_floats(const std::vector<float>& v) {
    u64(static_cast<std::uint64_t>(v.size()) * 4);
    for (float f : v) u32(std::bit_cast<std::uint32_t>(f));  // bit patterns: NaN payloads survive
  }
  std::vector<unsigned char>& bytes() { return out_; }

 private:
  std::vector<unsigned char> out_;
};

std::uint64_t load_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
std::uint32_t load_u32(const unsigned char* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Reads length-prefixed fields from the payload; any overrun or wrong field size is
// corruption (the checksum matched, so this is a writer bug or a forged file).
class Reader {
 public:
  Reader(const unsigned char* p, std::size_t n, const std::string& path) : p_(p), n_(n), path_(path) {}
  std::uint64_t length(const char* what) {
    need(8, what);
    std::uint64_t len = load_u64(p_ + at_);
    at_ += 8;
    if (len > n_ - at_) fail(std::string(what) + " runs past the end of the payload");
    return len;
  }
  std::uint64_t field_u64(const char* what) {
    if (length(what) != 8) fail(std::string(what) + " has the wrong size");
    std::uint64_t v = load_u64(p_ + at_);
    at_ += 8;
    return v;
  }
  std::int64_t field_i64(const char* what) { return static_cast<std::int64_t>(field_u64(what)); }
  std::string field_string(const char* what) {
    auto len = length(what);
    std::string s(reinterpret_cast<const char*>(p_ + at_), static_cast<std::size_t>(len));
    at_ += len;
    return s;
  }
  std::vector<float> field_floats(const char* what) {
    auto len = length(what);
    if (len % 4 != 0) fail(std::string(what) + " is not a whole number of floats");
    std::vector<float> v(static_cast<std::size_t>(len / 4));
    for (auto& f : v) {
      f = std::bit_cast<float>(load_u32(p_ + at_));
      at_ += 4;
    }
    return v;
  }
  void finish() {
    if (at_ != n_) fail(std::to_string(n_ - at_) + " unread bytes after the last field");
  }
  [[noreturn]] void fail(const std::string& why) const {
    throw CheckpointError("checkpoint '" + path_ + "' is corrupt: " + why);
  }

 private:
  void need(std::size_t k, const char* what) const {
    if (n_ - at_ < k) fail(std::string(what) + " runs past the end of the payload");
  }
  const unsigned char* p_;
  std::size_t n_;
  std::size_t at_ = 0;
  const std::string& path_;
};

std::vector<unsigned char> encode(const Checkpoint& c) {
  Writer payload;
  payload.field_string(c.fingerprint);
  payload.field_i64(c.step);
  payload.field_u64(c.data_position);
  payload.field_u64(c.seed);
  payload.field_u64(c.ranks.size());
  for (const auto& r : c.ranks) {
    payload.field_i64(r.rank);
    payload.field_floats(r.master_weights);
    payload.field_floats(r.first_moment);
    payload.field_floats(r.second_moment);
    payload.field_i64(r.optimizer_steps);
    payload.field_u64(std::bit_cast<std::uint64_t>(r.scaler.scale));
    payload.field_i64(r.scaler.good_steps);
    payload.field_i64(r.scaler.hysteresis_left);
  }
  Writer file;
  file.raw(kMagic, sizeof kMagic);
  file.u16(kCheckpointFormatVersion);
  file.u64(payload.bytes().size());
  file.raw(payload.bytes().data(), payload.bytes().size());
  file.u32(crc32(file.bytes().data(), file.bytes().size()));
  return std::move(file.bytes());
}

int to_int(std::int64_t v, const char* what, const Reader& r) {
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    r.fail(std::string(what) + " " + std::to_string(v) + " does not fit an int");
  return static_cast<int>(v);
}

Checkpoint decode(const std::vector<unsigned char>& bytes, const std::string& path) {
  auto truncated = [&](const std::string& detail) {
    return CheckpointError("checkpoint '" + path + "' is truncated: " + detail +
                           " (an interrupted save? use an older step-<N>.ckpt in the folder)");
  };
  if (bytes.size() < sizeof kMagic)
    throw truncated(std::to_string(bytes.size()) + " bytes, shorter than the header");
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0)
    throw CheckpointError("'" + path + "' is not a trainsim checkpoint (bad magic: expected \"TSCKPT\")");
  if (bytes.size() < kHeaderBytes)
    throw truncated(std::to_string(bytes.size()) + " bytes, shorter than the " +
                    std::to_string(kHeaderBytes) + "-byte header");
  const std::uint16_t version = static_cast<std::uint16_t>(bytes[6] | (bytes[7] << 8));
  if (version != kCheckpointFormatVersion)
    throw CheckpointError("checkpoint '" + path + "' has format version " + std::to_string(version) +
                          "; this build reads version " + std::to_string(kCheckpointFormatVersion));
  const std::uint64_t payload_len = load_u64(bytes.data() + 8);
  const std::uint64_t body = bytes.size() - kHeaderBytes;
  if (body < kTrailerBytes || payload_len > body - kTrailerBytes)
    throw truncated(std::to_string(bytes.size()) + " bytes, but the header announces " +
                    std::to_string(payload_len) + " bytes of payload (file should be " +
                    (payload_len > std::numeric_limits<std::uint64_t>::max() - kHeaderBytes - kTrailerBytes
                         ? std::string("larger")
                         : std::to_string(payload_len + kHeaderBytes + kTrailerBytes)) +
                    " bytes)");
  if (payload_len != body - kTrailerBytes)
    throw CheckpointError("checkpoint '" + path + "' is corrupt: " +
                          std::to_string(body - kTrailerBytes - payload_len) +
                          " unexpected bytes after the checksum");
  const std::size_t covered = kHeaderBytes + static_cast<std::size_t>(payload_len);
  const std::uint32_t stored = load_u32(bytes.data() + covered);
  const std::uint32_t actual = crc32(bytes.data(), covered);
  if (stored != actual) {
    char buf[80];
    std::snprintf(buf, sizeof buf, " (stored CRC-32 %08x, computed %08x)", stored, actual);
    throw CheckpointError("checkpoint '" + path + "' is corrupt: checksum mismatch" + buf);
  }

  Reader r(bytes.data() + kHeaderBytes, static_cast<std::size_t>(payload_len), path);
  Checkpoint c;
  c.fingerprint = r.field_string("fingerprint");
  c.step = to_int(r.field_i64("step"), "step", r);
  c.data_position = r.field_u64("data_position");
  c.seed = r.field_u64("seed");
  const std::uint64_t num_ranks = r.field_u64("rank count");
  // Each rank needs at least 8 fields of 8-byte length prefixes; reject absurd counts early.
  if (num_ranks > payload_len / 64) r.fail("rank count " + std::to_string(num_ranks) + " is impossible");
  c.ranks.resize(static_cast<std::size_t>(num_ranks));
  for (auto& rk : c.ranks) {
    rk.rank = to_int(r.field_i64("rank"), "rank", r);
    rk.master_weights = r.field_floats("master_weights");
    rk.first_moment = r.field_floats("first_moment");
    rk.second_moment = r.field_floats("second_moment");
    rk.optimizer_steps = r.field_i64("optimizer_steps");
    rk.scaler.scale = std::bit_cast<double>(r.field_u64("loss scale"));
    rk.scaler.good_steps = to_int(r.field_i64("good_steps"), "good_steps", r);
    rk.scaler.hysteresis_left = to_int(r.field_i64("hysteresis_left"), "hysteresis_left", r);
  }
  r.finish();
  return c;
}

// ---- files ----------------------------------------------------------------------------

[[noreturn]] void save_failed(const std::string& dir, const std::string& what, const std::string& path,
                              int err) {
  throw CheckpointError("cannot save checkpoint in '" + dir + "': " + what + " '" + path +
                        "' failed: " + std::strerror(err) +
                        " (the previous checkpoint and 'latest' are unchanged)");
}

// Writes `bytes` to `final_path` through `final_path`.tmp: write, fsync, close, rename.
void write_atomically(const std::string& dir, const std::string& final_path,
                      const unsigned char* bytes, std::size_t size) {
  const std::string tmp = final_path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) save_failed(dir, "creating", tmp, errno);
  auto fail = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(tmp.c_str());
    save_failed(dir, what, tmp, err);
  };
  std::size_t done = 0;
  while (done < size) {
    ssize_t n = ::write(fd, bytes + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("writing", errno);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) fail("flushing (fsync)", errno);
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    save_failed(dir, "closing", tmp, err);
  }
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    save_failed(dir, "renaming to '" + final_path + "'", tmp, err);
  }
}

// Makes the renames durable; best effort (some file systems refuse fsync on a folder).
void sync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::vector<unsigned char> read_all(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw CheckpointError("checkpoint '" + path + "' does not exist");
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw CheckpointError("cannot open checkpoint '" + path + "': " +
                          (errno ? std::strerror(errno) : "unknown error"));
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw CheckpointError("cannot read checkpoint '" + path + "'");
  return bytes;
}

std::string resolve(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  const std::string latest = (fs::path(path) / "latest").string();
  std::ifstream in(latest);
  if (!in)
    throw CheckpointError("no checkpoint in folder '" + path + "': '" + latest +
                          "' is missing (save_checkpoint writes it)");
  std::string name;
  std::getline(in, name);
  while (!name.empty() && (name.back() == '\r' || name.back() == ' ' || name.back() == '\t'))
    name.pop_back();
  if (name.empty() || name.find('/') != std::string::npos)
    throw CheckpointError("'" + latest + "' is corrupt: expected a file name like step-<N>.ckpt, got '" +
                          name + "'");
  return (fs::path(path) / name).string();
}

// Says where two fingerprints first differ, so a long fingerprint's mismatch is readable.
std::string first_difference(const std::string& a, const std::string& b) {
  std::size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return "they first differ at character " + std::to_string(i);
}

}  // namespace

std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < size; ++i) crc = kCrcTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

std::vector<unsigned char> encode_checkpoint(const Checkpoint& ckpt) { return encode(ckpt); }

Checkpoint decode_checkpoint(const std::vector<unsigned char>& bytes, const std::string& name) {
  return decode(bytes, name);
}

std::string save_checkpoint(const std::string& dir, const Checkpoint& ckpt) {
  if (ckpt.step < 0) throw CheckpointError("cannot save checkpoint: negative step " + std::to_string(ckpt.step));
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw CheckpointError("cannot save checkpoint: '" + dir + "' exists and is not a folder");
  fs::create_directories(dir, ec);
  if (ec) throw CheckpointError("cannot save checkpoint: creating folder '" + dir + "' failed: " + ec.message());

  const std::string name = "step-" + std::to_string(ckpt.step) + ".ckpt";
  const std::string file = (fs::path(dir) / name).string();
  const std::vector<unsigned char> bytes = encode(ckpt);
  write_atomically(dir, file, bytes.data(), bytes.size());
  sync_dir(dir);
  const std::string latest_text = name + "\n";
  write_atomically(dir, (fs::path(dir) / "latest").string(),
                   reinterpret_cast<const unsigned char*>(latest_text.data()), latest_text.size());
  sync_dir(dir);
  return file;
}

Checkpoint load_checkpoint(const std::string& path, const std::string& expected_fingerprint) {
  const std::string file = resolve(path);
  Checkpoint c = decode(read_all(file), file);
  if (!expected_fingerprint.empty() && c.fingerprint != expected_fingerprint)
    throw CheckpointError("checkpoint '" + file + "' belongs to another plan: fingerprint mismatch: "
                          "checkpoint has '" + c.fingerprint + "', this run expects '" +
                          expected_fingerprint + "'; " + first_difference(c.fingerprint, expected_fingerprint) +
                          " (resume with the same scenario and runtime settings, or start afresh)");
  return c;
}

}  // namespace trainsim::runtime
