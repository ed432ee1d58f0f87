// Rank 0 hands one small blob to every rank over TCP: the CUDA backend shares its 128-byte
// ncclUniqueId this way before ncclCommInitRank, with no MPI. POSIX sockets only.
//
// Protocol (all integers little-endian on the wire, written byte by byte):
//  1. Rank 0 listens on MASTER_ADDR:MASTER_PORT (SO_REUSEADDR, so a port left in TIME_WAIT by
//     the previous run is reusable) and accepts world_size - 1 connections.
//  2. Every other rank connects, retrying while nobody listens (rank 0 may start later), and
//     sends a hello: magic "TSRV", protocol version, its rank and its world size.
//  3. Rank 0 checks each hello: rank in [1, world_size), not seen before, world size equal to
//     its own. Once all ranks are there it sends each one status 0, a 64-bit length and the
//     blob; each rank answers one acknowledgement byte, and rank 0 closes once every rank has
//     acknowledged, so it never returns before all ranks hold the blob.
//  4. If rank 0 fails (a rank missing at the deadline, a duplicate rank, a world size that
//     disagrees, a peer that closed early) it sends status 1 and its error message to every
//     connected rank before it throws, so they fail at once with rank 0's reason instead of
//     waiting for their own timeout.
//
// One deadline, `timeout` after the call, bounds the gathering: rank 0 accepting ranks, the
// other ranks' connect retries. What follows gets a grace of timeout/4 (at most 1 s) beyond
// it: a connected rank waits that much longer for rank 0's answer, so it reports rank 0's
// reason (which ranks are missing) rather than a bare timeout when all ranks started together;
// rank 0 sends the blob and collects acknowledgements within max(deadline, end of gathering +
// grace), so ranks that arrive just before the deadline still succeed together. Every read and
// write is a poll with the remaining time: every rank returns or throws within timeout +
// grace. Failures throw RendezvousError naming this rank, the peer (rank and/or address) and
// what failed.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "runtime/launch/launch_env.h"

namespace trainsim::runtime {

class RendezvousError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Returns the blob rank 0 passed, on every rank (rank 0 gets a copy of its own). Only rank
// 0's `blob_on_rank0` is read; other ranks may pass an empty span. World size 1 returns the
// blob without opening a socket. Throws std::invalid_argument for a bad `env` (rank outside
// [0, world_size), port outside 1..65535) or a timeout that is not positive, before any
// network activity; RendezvousError for everything that fails on the network.
std::vector<std::uint8_t> broadcast_from_rank0(const LaunchEnv& env, std::span<const std::uint8_t> blob_on_rank0,
                                               std::chrono::milliseconds timeout);

}  // namespace trainsim::runtime
