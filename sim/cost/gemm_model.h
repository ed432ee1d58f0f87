// Matrix products priced by their shape (docs/model.md "Matrix products by shape").
//
// A GPU runs a product C(m x n) = A(m x k) B(k x n) as output tiles, one thread block per tile,
// in waves of as many tiles as it has SMs. cuBLAS picks the tile that finishes first; its
// time is
//   compute = 2 m n k batch / (peak * compute_efficiency * tile_use * wave_use * depth_use)
//     tile_use   m n / (tiles * tile area)                 (tile quantization)
//     wave_use   tiles / (waves * sm_count)                (wave quantization)
//     depth_use  k / (k + kDepthOverhead)                  (each tile's prologue and epilogue)
//     times the tile's own efficiency (smaller tiles reuse less: kTiles)
//   memory  = (m k + k n + m n) batch * element bytes / (HBM * memory_efficiency)
//   time    = sqrt(compute^2 + memory^2)    (a soft roofline: the two overlap, not perfectly)
// compute_efficiency is what cuBLAS reaches on large square products (docs/presets.md); the
// tile constants are checked against published cuBLASLt measurements (tests/test_cost_models.cpp).
#pragma once

#include "core/config.h"
#include "core/hardware_profile.h"

namespace trainsim {

struct GemmTile {
  int m, n;
  double efficiency;  // of a large product made of such tiles, relative to the best tile
};
// cuBLAS's usual Ampere/Hopper tensor-core tiles.
inline constexpr GemmTile kTiles[] = {{256, 128, 1.0}, {128, 256, 1.0}, {128, 128, 0.95},
                                      {128, 64, 0.85}, {64, 128, 0.85}, {64, 64, 0.65}};
inline constexpr double kDepthOverhead = 64;  // k lost per tile to its prologue and epilogue

// Fraction of the format's peak the product reaches on compute alone (0..compute_efficiency].
double gemm_compute_efficiency(const KernelShape& s, const ClusterConfig& cl);
// Seconds for the product, `elem_bytes` per element of A and B, at `peak_flops`; C moves
// `c_bytes` per element (< 0: written once in elem_bytes; 8 for a product that accumulates into
// an FP32 buffer, read and written).
double gemm_seconds(const KernelShape& s, double elem_bytes, double peak_flops, const ClusterConfig& cl,
                    double c_bytes = -1);
// Seconds to stream `bytes` through HBM.
double memory_seconds(double bytes, const ClusterConfig& cl);

}  // namespace trainsim
