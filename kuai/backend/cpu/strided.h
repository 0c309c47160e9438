// Strided iteration helpers for the CPU evals: copying between arbitrary strided layouts (views
// made contiguous, concatenation, broadcasting) with adjacent dims merged first and a memcpy
// or vector loop innermost.
#pragma once

#include <cstdint>

#include "kuai/core/tensor.h"

namespace kuai::cpu {

// dst[i] = src[i] over `shape`, each side with its own element strides (0 = broadcast).
void copy_strided(const void* src, const Shape& src_strides, void* dst, const Shape& dst_strides,
                  const Shape& shape, int64_t elem_size);

// Merge adjacent dims that are contiguous with each other in every stride list.
void collapse_dims(Shape& shape, Shape& strides_a, Shape& strides_b, Shape& strides_c);

}  // namespace kuai::cpu
