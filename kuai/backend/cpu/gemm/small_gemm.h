// A register-blocked fp32 GEMM for small products whose operands already sit in the caches: the
// block products of flash attention (128 x 128 x 64 and their like), which oneDNN's and OpenBLAS's
// general kernels run at 55-75% of the machine's best GEMM rate on the CPUs measured (their
// packing and blocking pay off on large operands, not on these). Nothing is packed: op(A) is read
// in place a micro-tile's rows at a time (broadcast, so A and A^T cost the same), op(B) is read in
// place, row by row, when it is not transposed, and is transposed once into the caller's scratch
// when it is. The micro-tile is 6 rows x 4 zmm vectors (64 columns) at the AVX-512 tiers, 6 x 2
// ymm at AVX2, so its accumulators fill the register file without spilling.
//
// Every element of C is one fp32 sum over k in order 0..K-1 in a vector lane (a fused multiply-add
// per term where the tier has FMA and the compiler contracts, as GCC does from -O2), then
// alpha * sum + beta * C: the result does not depend on the blocking, on where a tile starts or on
// the thread, so it is reproducible. Not bit-identical to oneDNN (its order of summation is its
// own), nor across tiers.
#pragma once

#include <cstdint>

namespace kuai::cpu {

// Floats of scratch small_gemm needs: K * N when trans_b (op(B) transposed into it), else 0.
int64_t small_gemm_scratch_floats(bool trans_b, int64_t N, int64_t K);

// C(M,N) = alpha op(A)(M,K) op(B)(K,N) + beta C, row-major with cpu::gemm's transposes and leading
// dimensions, on the calling thread (call it inside parallel regions, one product per thread).
// beta == 0 ignores C's contents. `scratch` holds small_gemm_scratch_floats(trans_b, N, K) floats
// (may be null when that is 0).
void small_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                int64_t ldc, float* scratch);

// dst (cols, rows) with row stride ldd = src^T, src (rows, cols) with row stride lds; 8 x 8 blocks
// through vector registers. On the calling thread.
void transpose_floats(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                      int64_t ldd);

}  // namespace kuai::cpu
