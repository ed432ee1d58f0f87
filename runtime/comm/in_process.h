// The CPU backend's communicator: ranks are threads of one process exchanging through
// shared mailboxes. The ring all-reduce really passes chunks from member to member.
#pragma once

#include <chrono>
#include <memory>

#include "runtime/comm/communicator.h"

namespace trainsim::runtime {

class InProcessWorld {
 public:
  // `timeout`: how long a recv or collective may wait before it fails with CommError.
  explicit InProcessWorld(int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(120));
  ~InProcessWorld();
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;

  int world_size() const;
  // The communicator of `rank`; it refers to this world, which must outlive it.
  std::unique_ptr<Communicator> communicator(int rank);
  // Bytes held in mailboxes right now and at most so far (messages sent, not yet received).
  std::size_t bytes_in_flight() const;
  std::size_t peak_bytes_in_flight() const;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
};

}  // namespace trainsim::runtime
