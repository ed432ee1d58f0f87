// Shared by the CUDA tests: skip cleanly (GTEST_SKIP) when no CUDA device can be used, so the
// suite runs, and passes, on machines without a GPU.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "kernels/device_buffer.h"

#define TRAINSIM_SKIP_WITHOUT_DEVICE()                                                 \
  do {                                                                                 \
    std::string trainsim_why_;                                                         \
    if (!::trainsim::cuda::device_available(&trainsim_why_))                           \
      GTEST_SKIP() << "no CUDA device: " << trainsim_why_;                             \
  } while (0)
