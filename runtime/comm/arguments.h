// Argument checks every communicator makes before it sends anything (communicator.h and
// device_communicator.h: wrong arguments are std::invalid_argument). `who` prefixes the
// message ("rank 3: ").
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>

namespace trainsim::runtime {

inline void check_peer(const std::string& who, int peer, int world_size, const char* what) {
  if (peer < 0 || peer >= world_size)
    throw std::invalid_argument(who + what + " rank " + std::to_string(peer) + ": no such rank (world size " +
                                std::to_string(world_size) + ")");
}

// Returns `rank`'s position among `members`, which must be strictly ascending ranks of the world.
inline int member_position(const std::string& who, std::span<const int> members, int rank, int world_size,
                           std::uint64_t tag, const char* op = "all_reduce") {
  const std::string where = who + op + " tag " + std::to_string(tag) + ": ";
  int me = -1;
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= world_size)
      throw std::invalid_argument(where + "member " + std::to_string(members[i]) + " is not a rank (world size " +
                                  std::to_string(world_size) + ")");
    if (i > 0 && members[i] <= members[i - 1])
      throw std::invalid_argument(where + "members must be strictly ascending, got " + std::to_string(members[i - 1]) +
                                  " then " + std::to_string(members[i]));
    if (members[i] == rank) me = static_cast<int>(i);
  }
  if (me < 0) throw std::invalid_argument(where + "this rank is not among the members");
  return me;
}

// reduce_scatter and all_gather split their buffer into one equal chunk per member, as NCCL does.
inline void check_equal_chunks(const std::string& who, std::size_t count, std::size_t members, std::uint64_t tag,
                               const char* op) {
  if (members > 0 && count % members != 0)
    throw std::invalid_argument(who + op + " tag " + std::to_string(tag) + ": " + std::to_string(count) +
                                " elements do not split into " + std::to_string(members) +
                                " equal chunks (pad the buffer to a multiple of the members)");
}

}  // namespace trainsim::runtime
