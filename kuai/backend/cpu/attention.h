// Naive attention for one (batch, head): the T x T probabilities are materialised (that is what
// makes it the reference for the flash kernel), but with a causal mask the GEMMs skip the key
// blocks above the diagonal, so only ~(1/2 + 32/T) of the square is multiplied. Operands are
// row-major with unit column stride and their own row strides (q, k, v may be column slices of
// one fused qkv buffer). `s` and `dp` are caller-provided T x T scratch.
#pragma once

#include <cstdint>

#include "kuai/backend/cpu/block_products.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {

inline constexpr int64_t kAttentionBlock = 64;  // query/key block of the causal skipping

struct HeadView {
  const float* q;  // (T, d), row stride ldq
  const float* k;
  const float* v;
  int64_t ldq, ldk, ldv;
};

// p (T, T) = softmax(scale * q k^T) with masked entries 0; y (T, d), row stride ldy = p v.
// With `bt` ((d, T) floats of work space), the products run on the small GEMM (block_products.h),
// k transposed into bt first; without it, on the libraries.
void attention_head_forward(const HeadView& h, float* p, float* y, int64_t ldy, int64_t T,
                            int64_t d, float scale, bool causal, float* s, float* bt = nullptr);

// From p and dy (row stride lddy): dq, dk, dv (T, d) with row strides lddq, lddk, lddv. With
// `bt`, the products run on the small GEMM, v transposed into bt first.
void attention_head_backward(const HeadView& h, const float* p, const float* dy, int64_t lddy,
                             float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                             int64_t lddv, int64_t T, int64_t d, float scale, bool causal,
                             float* dp, float* bt = nullptr);

// The fp32 naive kernels' products for T positions and head_dim d: kLibrary or kSmall, measured
// the first time a head_dim and T bucket (the power of two at or above T, 64 to 2048) is asked for
// (block_products.h: forward and backward of both at the bucket's T with two heads per thread;
// entry "naive products d64 T256 t2").
BlockProducts naive_attention_products(int64_t T, int64_t d);

// The same on operands stored as f32, bf16 or f16: q, k, v and dy are read, and y, dq, dk, dv
// written, in dtype `t` (rounded once from the fp32 result); p and the scratch are fp32. The
// products go through gemm_lowp, which on CPUs without bf16 units widens the operands while it
// packs them (gemm_packed.h), so no widened copy of a head is made.
struct TypedHeadView {
  const void* q;  // (T, d), row stride ldq, dtype t
  const void* k;
  const void* v;
  int64_t ldq, ldk, ldv;
  DType t;
};

// `bt` as above, used for fp32 heads only.
void attention_head_forward(const TypedHeadView& h, float* p, void* y, int64_t ldy, int64_t T,
                            int64_t d, float scale, bool causal, float* s, float* bt = nullptr);

void attention_head_backward(const TypedHeadView& h, const float* p, const void* dy, int64_t lddy,
                             void* dq, int64_t lddq, void* dk, int64_t lddk, void* dv, int64_t lddv,
                             int64_t T, int64_t d, float scale, bool causal, float* dp,
                             float* bt = nullptr);

}  // namespace kuai::cpu
