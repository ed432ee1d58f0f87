#include "sim/cost/gemm_model.h"

#include <algorithm>
#include <cmath>

#include "core/units.h"

namespace trainsim {

double gemm_tile_use(const KernelShape& s, int sm_count) {
  const double m = static_cast<double>(s.m), n = static_cast<double>(s.n);
  const double batch = static_cast<double>(std::max<long>(1, s.batch));
  double best = 0;
  for (const GemmTile& t : kTiles) {
    const double tiles_m = std::ceil(m / t.m), tiles_n = std::ceil(n / t.n);
    const double tiles = tiles_m * tiles_n * batch;
    const double tile_use = m * n / (tiles_m * t.m * tiles_n * t.n);
    double wave_use = 1;
    if (sm_count > 0) {
      const double waves = std::ceil(tiles / sm_count);
      wave_use = tiles / (waves * sm_count);
    }
    best = std::max(best, t.efficiency * tile_use * wave_use);
  }
  return best;
}

double gemm_efficiency_with(double tile_use, double k, const ClusterConfig& cl) {
  return cl.compute_efficiency * tile_use * k / (k + kDepthOverhead);
}

double gemm_compute_efficiency(const KernelShape& s, const ClusterConfig& cl) {
  if (!s.is_matmul() || s.n <= 0 || s.k <= 0) return cl.compute_efficiency;
  return gemm_efficiency_with(gemm_tile_use(s, cl.sm_count), static_cast<double>(s.k), cl);
}

double memory_seconds(double bytes, const ClusterConfig& cl) {
  return bytes / (gbps_to_bytes_per_second(cl.hbm_bandwidth_gbps) * cl.memory_efficiency);
}

double gemm_io_bytes(const KernelShape& s, double elem_bytes, double c_bytes) {
  const double m = static_cast<double>(s.m), n = static_cast<double>(s.n), k = static_cast<double>(s.k);
  const double c = c_bytes < 0 ? elem_bytes : c_bytes;
  return ((m * k + k * n) * elem_bytes + m * n * c) * static_cast<double>(std::max<long>(1, s.batch));
}

double gemm_seconds_with(double flops, double efficiency, double io_bytes, double peak_flops, const ClusterConfig& cl) {
  const double compute = flops / (peak_flops * efficiency);
  const double memory = memory_seconds(io_bytes, cl);
  return std::sqrt(compute * compute + memory * memory);
}

double gemm_seconds(const KernelShape& s, double elem_bytes, double peak_flops, const ClusterConfig& cl,
                    double c_bytes) {
  if (s.flops() <= 0) return 0;
  return gemm_seconds_with(s.flops(), gemm_compute_efficiency(s, cl), gemm_io_bytes(s, elem_bytes, c_bytes),
                           peak_flops, cl);
}

}  // namespace trainsim
