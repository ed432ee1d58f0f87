// The CUDA target: built wherever nvcc exists; device checks skip when no GPU is present.
// Also the allocators a rank's peak memory is read from: the account its DeviceBuffers and
// cuBLAS workspaces are charged to, and its stream-ordered pool.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "kernels/cublas_api.h"
#include "kernels/device_buffer.h"
#include "kernels/device_info.h"
#include "kernels/gemm.h"
#include "runtime/cuda/stream_ops.h"

namespace trainsim {
namespace {

TEST(Cuda, RuntimeAndNcclAreLinked) {
  // These need the libraries, not a device.
  const CudaInventory inv = query_cuda_devices();
  EXPECT_GT(inv.runtime_version, 0);
  EXPECT_GT(inv.nccl_version, 0);
}

// The shared objects mapped into this process now (/proc/self/maps).
std::string mapped_files() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return text.str();
}

TEST(Cuda, CublasIsOpenedByTheFirstProductNotAtStart) {
  // Each test runs in a process of its own (gtest_discover_tests), so nothing before this test
  // made a product. Opening cuBLAS needs the libraries, not a device.
  ASSERT_FALSE(mapped_files().empty());
  EXPECT_EQ(mapped_files().find("libcublasLt.so"), std::string::npos) << "cuBLASLt was loaded at start";
  EXPECT_EQ(mapped_files().find("libcublas.so"), std::string::npos) << "cuBLAS was loaded at start";
  const cuda::CublasApi& api = cuda::cublas();
#define TRAINSIM_EXPECT_RESOLVED(member, symbol, ...) EXPECT_NE(api.member, nullptr) << #symbol;
  TRAINSIM_CUBLAS_ENTRIES(TRAINSIM_EXPECT_RESOLVED)
  TRAINSIM_CUBLAS_OVERLOADED_ENTRIES(TRAINSIM_EXPECT_RESOLVED)
  TRAINSIM_CUBLASLT_ENTRIES(TRAINSIM_EXPECT_RESOLVED)
#undef TRAINSIM_EXPECT_RESOLVED
  EXPECT_NE(mapped_files().find("libcublasLt.so"), std::string::npos);
  EXPECT_EQ(&cuda::cublas(), &api);  // opened once
  EXPECT_STREQ(api.status_name(CUBLAS_STATUS_NOT_INITIALIZED), "CUBLAS_STATUS_NOT_INITIALIZED");
}

TEST(Cuda, DevicesAreOnesWeBuildFor) {
  const CudaInventory inv = query_cuda_devices();
  if (inv.devices.empty()) GTEST_SKIP() << "no CUDA device: " << inv.error;
  for (const auto& d : inv.devices) {
    SCOPED_TRACE(d.name);
    EXPECT_GT(d.memory_gib, 1.0);
    EXPECT_GT(d.multiprocessors, 0);
    // Kernels are compiled for sm_80 and sm_90 (CMAKE_CUDA_ARCHITECTURES).
    EXPECT_GE(d.compute_capability_major * 10 + d.compute_capability_minor, 80);
  }
}

TEST(Cuda, DeviceBuffersAreChargedToTheAllocatingThreadsAccountUntilFreed) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  cuda::MemoryAccount account;
  constexpr std::size_t workspace = 1u << 20;
  {
    cuda::AccountScope scope(&account);
    cuda::DeviceBuffer a(1000);
    EXPECT_EQ(account.current(), 1000u);
    cuda::DeviceBuffer moved = std::move(a);  // the charge moves with the allocation
    EXPECT_EQ(account.current(), 1000u);
    {
      cuda::AccountScope nobody(nullptr);
      cuda::DeviceBuffer uncharged(500);
      EXPECT_EQ(account.current(), 1000u);
    }
    cuda::GemmContext gemm(nullptr, workspace);
    EXPECT_EQ(account.current(), 1000u + workspace);
    // Freed on another thread: refunded to the account it was charged to.
    std::thread([b = std::move(moved)]() mutable { b = cuda::DeviceBuffer(); }).join();
    EXPECT_EQ(account.current(), workspace);
  }
  EXPECT_EQ(cuda::current_account(), nullptr);
  EXPECT_EQ(account.current(), 0u);
  EXPECT_EQ(account.peak(), 1000u + workspace);
  account.reset_peak();
  EXPECT_EQ(account.peak(), 0u);
}

TEST(Cuda, APoolsHighWaterMarkIsTheMostHandedOutAtOnce) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  cuda::Stream stream;
  runtime::cuda::MemoryPool pool(0);
  constexpr std::size_t mib = 1u << 20;
  void* a = pool.allocate(8 * mib, stream.get(), "a");
  void* b = pool.allocate(4 * mib, stream.get(), "b");
  pool.free(a, stream.get());
  void* c = pool.allocate(2 * mib, stream.get(), "c");
  stream.synchronize();
  // 12 MiB at once (a and b); c came after a was freed. The pool rounds to its granularity.
  EXPECT_GE(pool.used_high(), 12 * mib);
  EXPECT_LT(pool.used_high(), 14 * mib);
  EXPECT_GE(pool.reserved_high(), pool.used_high());
  pool.free(b, stream.get());
  pool.free(c, stream.get());
  stream.synchronize();
  pool.reset_high();
  void* d = pool.allocate(mib, stream.get(), "d");
  stream.synchronize();
  EXPECT_GE(pool.used_high(), mib);
  EXPECT_LT(pool.used_high(), 12 * mib) << "reset between steps";
  pool.free(d, stream.get());
  stream.synchronize();
}

// The gate holds a stream's later work until opened as often as asked, whichever thread opens
// it, and a wait nobody answers lets its stream go on, saying so.
TEST(Cuda, AHostGateHoldsItsStreamsUntilOpenedEnoughAndNeverForever) {
  std::string why;
  if (!cuda::device_available(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  cuda::Stream a, b;
  cuda::DeviceBuffer src(4), dst_a(4), dst_b(4);
  const std::uint32_t one = 1, zero = 0;
  src.upload(&one, 4);
  dst_a.upload(&zero, 4);
  dst_b.upload(&zero, 4);
  cuda::HostGate gate;
  constexpr std::uint64_t minute = 60'000'000'000;
  gate.wait(a.get(), 2, minute);
  cuda::copy_device_to_device(dst_a.data(), src.data(), 4, a.get());
  gate.wait(b.get(), 2, minute);
  cuda::copy_device_to_device(dst_b.data(), src.data(), 4, b.get());
  gate.open();
  // Held: 50 ms is thousands of times what the copies take once let go.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::uint32_t seen = 7;
  cuda::copy_to_host(&seen, dst_a.data(), 4);  // a legacy-stream copy: does not wait for a or b
  EXPECT_EQ(seen, 0u) << "stream a ran before the gate had been opened twice";
  std::thread([&] { gate.open(); }).join();
  a.synchronize();
  b.synchronize();
  cuda::copy_to_host(&seen, dst_b.data(), 4);
  EXPECT_EQ(seen, 1u);
  EXPECT_EQ(gate.opened(), 2u);
  EXPECT_FALSE(gate.timed_out());

  gate.wait(a.get(), 3, 1'000'000);  // 1 ms, never opened
  a.synchronize();
  EXPECT_TRUE(gate.timed_out());

  cuda::HostGate released;
  released.wait(a.get(), 1'000, minute);
  released.release();
  a.synchronize();  // returns: a released gate holds nothing, now or later
  released.open();
  released.wait(a.get(), 1'000'000, minute);
  a.synchronize();
  EXPECT_FALSE(released.timed_out());
}

}  // namespace
}  // namespace trainsim
