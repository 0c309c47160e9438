// A cache-blocked GEMM of our own for the mixed-precision products on CPUs without bf16
// arithmetic. Operands stored as f32, bf16 or f16 are widened to fp32 *while they are packed*
// into the panels the micro-kernel reads, and a low-precision C is rounded in registers as the
// micro-kernel's tile is stored; so no widened copy of an operand or of C ever goes through
// memory. The packing copy is one every fast GEMM makes anyway (OpenBLAS and oneDNN pack their
// fp32 operands too), so the conversion rides on it.
//
// Blocking follows BLIS (Van Zee & van de Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS
// Functionality"): for each NC-wide column panel of op(B) and each KC-deep slice of K, op(B) is
// packed once into 16-column slivers shared by all threads; each thread packs MC-row blocks of
// op(A) into 6-row slivers and runs a 6x16 AVX2+FMA micro-kernel over them, accumulating fp32 in
// twelve ymm registers. The summation order of every element depends on K and KC only, never on
// the thread count, so results are reproducible.
#pragma once

#include <cstdint>

#include "kuai/core/dtype.h"

namespace kuai::cpu {

// True when the tier in force (isa.h) has what the micro-kernel needs (AVX2, FMA, F16C) and this
// build compiled it (x86-64 with GCC or Clang).
bool packed_gemm_available();

// C(M,N) = alpha op(A)(M,K) op(B)(K,N) + beta C (+ bias(N) on every row when bias is not null),
// all row-major with the transposes and leading dimensions of cpu::gemm. A, B: kF32, kBF16 or kF16;
// C: kF32, kBF16 or kF16; bias: fp32. Accumulation is fp32; a low-precision C is read widened
// (when beta != 0) and written rounded to nearest even once, after the whole K (through a bounded
// fp32 block from the tracking allocator when K is longer than one KC slice). beta == 0 ignores
// C's contents. Requires packed_gemm_available(); K may be 0.
void gemm_packed(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype,
                 int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc,
                 const float* bias = nullptr);

// The block sizes (rows of op(A) per packed block, depth of a K slice, columns of op(B) per packed
// panel) and the fp32 accumulator budget (floats) for a low-precision C with K > KC. A testing
// hook: small values force every blocking edge on small products; 0 restores a default. MC is
// rounded up to a multiple of 6 and NC to a multiple of 16.
struct PackedGemmBlocking {
  int64_t mc = 0, kc = 0, nc = 0, c_budget = 0;
};
void set_packed_gemm_blocking(PackedGemmBlocking b);
PackedGemmBlocking packed_gemm_blocking();  // the sizes in force

}  // namespace kuai::cpu
