#include "sim/cost/gemm_model.h"

#include <algorithm>
#include <cmath>

#include "core/units.h"

namespace trainsim {

double gemm_compute_efficiency(const KernelShape& s, const ClusterConfig& cl) {
  if (!s.is_matmul() || s.n <= 0 || s.k <= 0) return cl.compute_efficiency;
  const double m = static_cast<double>(s.m), n = static_cast<double>(s.n), k = static_cast<double>(s.k);
  const double batch = static_cast<double>(std::max<long>(1, s.batch));
  double best = 0;
  for (const GemmTile& t : kTiles) {
    const double tiles_m = std::ceil(m / t.m), tiles_n = std::ceil(n / t.n);
    const double tiles = tiles_m * tiles_n * batch;
    const double tile_use = m * n / (tiles_m * t.m * tiles_n * t.n);
    double wave_use = 1;
    if (cl.sm_count > 0) {
      const double waves = std::ceil(tiles / cl.sm_count);
      wave_use = tiles / (waves * cl.sm_count);
    }
    best = std::max(best, t.efficiency * tile_use * wave_use);
  }
  return cl.compute_efficiency * best * k / (k + kDepthOverhead);
}

double memory_seconds(double bytes, const ClusterConfig& cl) {
  return bytes / (gbps_to_bytes_per_second(cl.hbm_bandwidth_gbps) * cl.memory_efficiency);
}

double gemm_seconds(const KernelShape& s, double elem_bytes, double peak_flops, const ClusterConfig& cl,
                    double c_bytes) {
  if (s.flops() <= 0) return 0;
  const double compute = s.flops() / (peak_flops * gemm_compute_efficiency(s, cl));
  const double m = static_cast<double>(s.m), n = static_cast<double>(s.n), k = static_cast<double>(s.k);
  const double c = c_bytes < 0 ? elem_bytes : c_bytes;
  const double io = ((m * k + k * n) * elem_bytes + m * n * c) * static_cast<double>(std::max<long>(1, s.batch));
  const double memory = memory_seconds(io, cl);
  return std::sqrt(compute * compute + memory * memory);
}

}  // namespace trainsim
