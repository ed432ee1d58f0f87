// Checkpoints (runtime/checkpoint.h): the files `trainsim run --resume` reads. Whatever bytes
// a checkpoint file holds:
//   * decode_checkpoint reads them or throws CheckpointError (never another exception, a
//     crash, undefined behaviour, a leak, or an allocation the file's size does not justify);
//   * what it reads is exactly what was written: encoding it again gives the same bytes.
// Random bytes almost never carry a valid CRC-32, so each input is tried twice: as it is (the
// header and checksum checks) and, when it starts with the magic, with its payload length and
// CRC-32 rewritten to match (the payload's fields behind the checksum).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "runtime/checkpoint.h"

namespace {

void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_checkpoint: property violated: %s\n", what);
  std::abort();
}

void check(const std::vector<unsigned char>& bytes) {
  try {
    const trainsim::runtime::Checkpoint c = trainsim::runtime::decode_checkpoint(bytes, "fuzz.ckpt");
    require(trainsim::runtime::encode_checkpoint(c) == bytes, "encode(decode(bytes)) == bytes");
  } catch (const trainsim::runtime::CheckpointError&) {
  }
}

constexpr std::size_t kHeader = 6 + 2 + 8, kTrailer = 4;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<unsigned char> bytes(data, data + size);
  check(bytes);
  if (size >= kHeader + kTrailer && std::memcmp(data, "TSCKPT", 6) == 0) {
    const std::uint64_t payload = size - kHeader - kTrailer;
    for (int i = 0; i < 8; ++i) bytes[8 + i] = static_cast<unsigned char>(payload >> (8 * i));
    const std::uint32_t crc = trainsim::runtime::crc32(bytes.data(), size - kTrailer);
    for (int i = 0; i < 4; ++i) bytes[size - kTrailer + i] = static_cast<unsigned char>(crc >> (8 * i));
    check(bytes);
  }
  return 0;
}
