// Per-rank streams and green-context SM partitions (sm_partition.h).
//
// The green-context entry points come from the driver at run time through
// cudaGetDriverEntryPointByVersion, each at the version its cudaTypedefs.h typedef names, so
// this file needs only cuda.h's types and the binary does not link libcuda. The recipe is the
// driver documentation's ("Green Contexts"): the device's SM resource, split into equal groups,
// one descriptor per group and, from it, one green context per host thread of the rank (the
// compute thread's and the communication thread's, on the same SMs: sm_partition.h), streams
// created in the green contexts.
#include "runtime/cuda/sm_partition.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "kernels/cuda_check.h"

#include <algorithm>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainsim::runtime::cuda {

namespace {

using ::trainsim::cuda::check_cuda;

std::string cuda_version_text(int version) { return fmt::format("{}.{}", version / 1000, version % 1000 / 10); }

std::string plural(int n, const char* one, const char* many) { return fmt::format("{} {}", n, n == 1 ? one : many); }

// The driver functions green contexts need; all null until load() succeeds.
struct DriverApi {
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetDevResource_v12040 device_get_dev_resource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 sm_resource_split_by_count = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 resource_generate_desc = nullptr;
  PFN_cuGreenCtxCreate_v12040 green_ctx_create = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 green_ctx_stream_create = nullptr;
  PFN_cuGreenCtxDestroy_v12040 green_ctx_destroy = nullptr;
  PFN_cuStreamDestroy_v4000 stream_destroy = nullptr;
  PFN_cuCtxFromGreenCtx_v12040 ctx_from_green_ctx = nullptr;
  PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;

  // Empty when every function was found, else why not.
  std::string load() {
    std::string why;
    auto find = [&why](const char* symbol, unsigned version, auto& function) {
      if (!why.empty()) return;
      void* address = nullptr;
      cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &address, version, cudaEnableDefault, &status);
      if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || address == nullptr) {
        cudaGetLastError();  // clear it, so later calls start clean
        int driver = 0;
        cudaDriverGetVersion(&driver);
        why = fmt::format("the driver (CUDA {}) has no {} of CUDA {} ({})", cuda_version_text(driver), symbol,
                          cuda_version_text(static_cast<int>(version)),
                          err != cudaSuccess ? cudaGetErrorString(err)
                          : status == cudaDriverEntryPointVersionNotSufficent ? "version not sufficient"
                                                                               : "symbol not found");
        return;
      }
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(address);
    };
    find("cuGetErrorName", 6000, get_error_name);
    find("cuDeviceGet", 2000, device_get);
    find("cuDeviceGetDevResource", 12040, device_get_dev_resource);
    find("cuDevSmResourceSplitByCount", 12040, sm_resource_split_by_count);
    find("cuDevResourceGenerateDesc", 12040, resource_generate_desc);
    find("cuGreenCtxCreate", 12040, green_ctx_create);
    find("cuGreenCtxStreamCreate", 12050, green_ctx_stream_create);
    find("cuGreenCtxDestroy", 12040, green_ctx_destroy);
    find("cuStreamDestroy", 4000, stream_destroy);
    find("cuCtxFromGreenCtx", 12040, ctx_from_green_ctx);
    find("cuCtxSetCurrent", 4000, ctx_set_current);
    find("cuCtxGetCurrent", 4000, ctx_get_current);
    return why;
  }

  std::string error(CUresult result, const char* what) const {
    const char* name = nullptr;
    if (get_error_name == nullptr || get_error_name(result, &name) != CUDA_SUCCESS || name == nullptr)
      return fmt::format("{} failed with CUresult {}", what, static_cast<int>(result));
    return fmt::format("{} failed: {}", what, name);
  }
};

}  // namespace

struct SmPartition::State {
  int device = 0;
  std::string device_name;
  int compute_major = 0;
  int compute_minor = 0;
  int device_sms = 0;
  bool green = false;
  std::string why_not_green;
  DriverApi driver;
  std::vector<RankStreams> streams;
  bool streams_are_green = false;  // which call destroys them
  // Green contexts, per rank: [2 r] its compute thread's, [2 r + 1] its communication thread's.
  std::vector<CUgreenCtx> green_contexts;
  CUcontext primary = nullptr;  // the device's primary context, under green contexts

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() { release(); }

  // Destroys what was created, streams before the green contexts they belong to (the driver does
  // not destroy them with the context). Errors are ignored: nothing can be done about them here.
  void release() noexcept {
    for (const RankStreams& rank : streams) {
      for (StreamHandle stream : {rank.compute, rank.comm, rank.send}) {
        if (stream == nullptr) continue;
        if (streams_are_green)
          driver.stream_destroy(static_cast<CUstream>(stream));
        else
          cudaStreamDestroy(static_cast<cudaStream_t>(stream));
      }
    }
    streams.clear();
    for (CUgreenCtx context : green_contexts) driver.green_ctx_destroy(context);
    green_contexts.clear();
    primary = nullptr;
  }

  void create_shared(int ranks) {
    streams_are_green = false;
    for (int r = 0; r < ranks; ++r) {
      RankStreams& rank = streams.emplace_back();
      rank.sms = device_sms;
      for (StreamHandle* stream : {&rank.compute, &rank.comm, &rank.send}) {
        cudaStream_t created = nullptr;
        check_cuda(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking),
              fmt::format("cudaStreamCreateWithFlags for rank {} of {}", r, ranks));
        *stream = created;
      }
    }
  }

  // Creates two green contexts and three streams per rank; on failure releases what it made and
  // returns why, so that SmSharing::automatic can fall back to shared streams.
  std::string try_green(int ranks) {
    if (std::string why = driver.load(); !why.empty()) return why;

    CUdevice dev = 0;
    if (CUresult r = driver.device_get(&dev, device); r != CUDA_SUCCESS) return driver.error(r, "cuDeviceGet");
    CUdevResource whole{};
    if (CUresult r = driver.device_get_dev_resource(dev, &whole, CU_DEV_RESOURCE_TYPE_SM); r != CUDA_SUCCESS)
      return driver.error(r, "cuDeviceGetDevResource");

    const int available = static_cast<int>(whole.sm.smCount);
    SmGranularity granularity{static_cast<int>(whole.sm.minSmPartitionSize),
                              static_cast<int>(whole.sm.smCoscheduledAlignment)};
    if (granularity.min_partition <= 0 || granularity.alignment <= 0)
      granularity = sm_granularity_guideline(compute_major);
    if (granularity.min_partition <= 0)
      return fmt::format("no SM partition size is known for compute capability {}.{}", compute_major, compute_minor);
    const int smallest = (granularity.min_partition + granularity.alignment - 1) / granularity.alignment *
                         granularity.alignment;

    const int fair_share = sms_per_rank(available, ranks, granularity.min_partition, granularity.alignment);
    if (fair_share == 0)
      return fmt::format("{} need at least {} SMs each ({} in all; partitions are multiples of {}), the device has {}",
                         plural(ranks, "rank", "ranks"), smallest, smallest * ranks, granularity.alignment, available);

    // The driver may make fewer groups than the arithmetic allows (SMs are grouped by GPC, and a
    // group must not straddle co-scheduled SMs), so smaller partitions are tried until `ranks`
    // groups come out.
    std::vector<CUdevResource> groups(static_cast<std::size_t>(ranks));
    std::string why;
    bool split = false;
    for (int count = fair_share; count >= smallest && !split; count -= granularity.alignment) {
      std::fill(groups.begin(), groups.end(), CUdevResource{});
      unsigned int made = static_cast<unsigned int>(ranks);
      CUdevResource remaining{};
      const CUresult r = driver.sm_resource_split_by_count(groups.data(), &made, &whole, &remaining, 0,
                                                           static_cast<unsigned int>(count));
      if (r != CUDA_SUCCESS)
        why = driver.error(r, fmt::format("cuDevSmResourceSplitByCount into {} x {} SMs", ranks, count).c_str());
      else if (made < static_cast<unsigned int>(ranks))
        why = fmt::format("the driver splits the {} SMs into only {} groups of {}", available, made, count);
      else
        split = true;
    }
    if (!split) return why;

    if (CUresult e = driver.ctx_get_current(&primary); e != CUDA_SUCCESS) return driver.error(e, "cuCtxGetCurrent");
    streams_are_green = true;
    for (int r = 0; r < ranks; ++r) {
      CUdevResourceDesc desc = nullptr;
      if (CUresult e = driver.resource_generate_desc(&desc, &groups[static_cast<std::size_t>(r)], 1); e != CUDA_SUCCESS)
        return fail(driver.error(e, "cuDevResourceGenerateDesc"));
      CUgreenCtx contexts[2] = {nullptr, nullptr};  // RankThread::compute, RankThread::comm
      for (CUgreenCtx& context : contexts) {
        if (CUresult e = driver.green_ctx_create(&context, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM); e != CUDA_SUCCESS)
          return fail(driver.error(e, "cuGreenCtxCreate"));
        green_contexts.push_back(context);
      }

      RankStreams& rank = streams.emplace_back();
      rank.sms = static_cast<int>(groups[static_cast<std::size_t>(r)].sm.smCount);
      const std::pair<StreamHandle*, CUgreenCtx> made_in[] = {
          {&rank.compute, contexts[0]}, {&rank.send, contexts[0]}, {&rank.comm, contexts[1]}};
      for (const auto& [stream, context] : made_in) {
        CUstream created = nullptr;
        if (CUresult e = driver.green_ctx_stream_create(&created, context, CU_STREAM_NON_BLOCKING, 0);
            e != CUDA_SUCCESS)
          return fail(driver.error(e, "cuGreenCtxStreamCreate"));
        *stream = created;
      }
    }
    return {};
  }

  std::string fail(std::string why) {
    release();
    return why;
  }
};

SmPartition::SmPartition(int ranks, SmSharing sharing, int device) : state_(std::make_unique<State>()) {
  if (ranks < 1) throw std::invalid_argument("SmPartition: ranks must be at least 1, got " + std::to_string(ranks));
  State& s = *state_;
  s.device = device;
  // The primary context first: green contexts share its memory, and the driver documentation
  // asks for it to exist before green contexts are made.
  check_cuda(cudaSetDevice(device), fmt::format("cudaSetDevice({})", device));
  check_cuda(cudaFree(nullptr), fmt::format("cudaFree(nullptr) creating the primary context of device {}", device));
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), fmt::format("cudaGetDeviceProperties({})", device));
  s.device_name = prop.name;
  s.compute_major = prop.major;
  s.compute_minor = prop.minor;
  s.device_sms = prop.multiProcessorCount;

  if (sharing == SmSharing::shared)
    s.why_not_green = "not requested";
  else if (sharing == SmSharing::automatic && ranks == 1)
    s.why_not_green = "one rank: nothing to split";
  else
    s.why_not_green = s.try_green(ranks);

  s.green = s.why_not_green.empty();
  if (!s.green) {
    if (sharing == SmSharing::green_contexts)
      throw std::runtime_error(fmt::format("SmPartition: no green contexts for {} on {} (device {}): {}",
                                           plural(ranks, "rank", "ranks"), s.device_name, device, s.why_not_green));
    s.create_shared(ranks);
  }
}

SmPartition::~SmPartition() = default;
SmPartition::SmPartition(SmPartition&& other) noexcept = default;
SmPartition& SmPartition::operator=(SmPartition&& other) noexcept = default;

int SmPartition::ranks() const { return static_cast<int>(state_->streams.size()); }

const RankStreams& SmPartition::streams(int rank) const {
  if (rank < 0 || rank >= ranks())
    throw std::out_of_range(fmt::format("SmPartition::streams: rank {} is outside [0, {})", rank, ranks()));
  return state_->streams[static_cast<std::size_t>(rank)];
}

bool SmPartition::green() const { return state_->green; }

void SmPartition::make_current(int rank, RankThread thread) const {
  streams(rank);  // range check
  const State& s = *state_;
  if (!s.green) {
    make_primary_current();
    return;
  }
  const std::size_t index = 2 * static_cast<std::size_t>(rank) + (thread == RankThread::comm ? 1 : 0);
  CUcontext context = nullptr;
  if (CUresult e = s.driver.ctx_from_green_ctx(&context, s.green_contexts[index]); e != CUDA_SUCCESS)
    throw std::runtime_error(s.driver.error(e, "cuCtxFromGreenCtx"));
  if (CUresult e = s.driver.ctx_set_current(context); e != CUDA_SUCCESS)
    throw std::runtime_error(s.driver.error(e, "cuCtxSetCurrent"));
}

void SmPartition::make_primary_current() const {
  const State& s = *state_;
  if (s.primary != nullptr) {
    if (CUresult e = s.driver.ctx_set_current(s.primary); e != CUDA_SUCCESS)
      throw std::runtime_error(s.driver.error(e, "cuCtxSetCurrent (primary context)"));
    return;
  }
  if (cudaError_t err = cudaSetDevice(s.device); err != cudaSuccess)
    throw std::runtime_error(fmt::format("SmPartition::make_primary_current: cudaSetDevice({}): {}", s.device,
                                         cudaGetErrorString(err)));
}

int SmPartition::device_sms() const { return state_->device_sms; }

const std::string& SmPartition::why_not_green() const { return state_->why_not_green; }

std::string SmPartition::describe() const {
  const State& s = *state_;
  const std::string where = fmt::format("{} (device {})", s.device_name, s.device);
  if (!s.green)
    return fmt::format("shared SMs: {} on all {} SMs of {} (green contexts: {})", plural(ranks(), "rank", "ranks"),
                       s.device_sms, where, s.why_not_green);
  int fewest = s.streams.front().sms;
  int most = fewest;
  int used = 0;
  for (const RankStreams& rank : s.streams) {
    fewest = std::min(fewest, rank.sms);
    most = std::max(most, rank.sms);
    used += rank.sms;
  }
  const std::string each = fewest == most ? std::to_string(fewest) : fmt::format("{}-{}", fewest, most);
  return fmt::format("green contexts: {} x {} SMs ({} left over) of {} on {}", plural(ranks(), "rank", "ranks"), each,
                     plural(s.device_sms - used, "SM", "SMs"), s.device_sms, where);
}

}  // namespace trainsim::runtime::cuda
