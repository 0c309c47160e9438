// The register tile kuai's own fp32 GEMMs share (small_gemm.h for attention's block products,
// blocked.h for the model's): GCC vector types of W floats, and per tier a tile of kTileRows rows
// x kNV vectors, its accumulators plus the vectors of B and one broadcast of A within the
// register file. The kernels are compiled once per tier with these (isa.h's KUAI_TARGET_*).
#pragma once

#include "kuai/backend/cpu/float_vec.h"

namespace kuai::cpu::tile {

template <int W>
struct Vec {
  typedef typename FloatVec<W>::type v;
};

constexpr int kTileRows = 6;

struct Avx512 {
  static constexpr int kW = 16, kNV = 4;  // 6 x 64: 24 zmm accumulators of 32
};
struct Avx2 {
  static constexpr int kW = 8, kNV = 2;  // 6 x 16: 12 ymm accumulators of 16
};
struct Baseline {
  static constexpr int kW = 4, kNV = 2;  // 6 x 8: 12 xmm accumulators of 16
};

}  // namespace kuai::cpu::tile
