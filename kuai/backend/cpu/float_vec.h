// A GCC vector of W fp32 lanes (W = 4, 8, 16: one SSE, AVX or AVX-512 register), for kernels
// written once over the width: the register tile of kuai's GEMMs (gemm/register_tile.h) and the
// row maximum (vec_math.h).
#pragma once

namespace kuai::cpu {

template <int W>
struct FloatVec;
template <>
struct FloatVec<16> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct FloatVec<8> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct FloatVec<4> {
  typedef float type __attribute__((vector_size(16)));
};

}  // namespace kuai::cpu
