// Bulk conversion between dtypes on the CPU (convert.cpp): the Cast primitive's kernel, and what
// kernels use to widen low-precision operands or narrow their results.
#pragma once

#include <cstdint>

#include "kuai/core/dtype.h"

namespace kuai {

// Bulk conversion between any two dtypes (n elements). Floats to integers truncate toward zero.
// Large conversions run in parallel (OpenMP) unless called from inside a parallel region.
void convert(const void* src, DType src_type, void* dst, DType dst_type, int64_t n);

// convert() on the calling thread only, never forking OpenMP threads: for callers already inside
// a parallel region that convert one chunk each. Same results and the same fast loops.
void convert_serial(const void* src, DType src_type, void* dst, DType dst_type, int64_t n);

}  // namespace kuai
