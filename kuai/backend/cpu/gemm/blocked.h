// kuai's own cache-blocked fp32 GEMM, a candidate the router (router.h) races against oneDNN and
// OpenBLAS for every fp32 product (gemm, gemm_bias). The micro-kernel is small_gemm's register
// tile widened to the BLIS loop nest (Van Zee & van de Geijn; Low et al., "Analytical modeling is
// enough for high-performance BLIS"): for each NC-wide column panel and KC-deep slice, op(B) is
// packed once into NR-column slivers shared by the threads; each thread packs an MC-row block of
// op(A) (k-major, so a tile's MR values of one k sit together) and runs the MR x NR register tile
// over it, one B sliver at a time, the sliver held in L1 while every row tile of the block passes
// over it. op(A) not transposed is read in place instead (a tile's six rows are six streams
// the prefetchers follow; only a last partial tile is packed). One body in GCC vector types,
// compiled per tier: 6 x 64 (four zmm per row, 24 accumulators) at the AVX-512 tiers, 6 x 16
// (two ymm) at AVX2, 6 x 8 at the baseline. The block sizes come from the running CPU's cache
// sizes (blocked.cpp says how), not from constants measured on one CPU.
//
// Every element of C is the fp32 sum over one K slice in order (a fused multiply-add per term
// where the tier has FMA and the compiler contracts), alpha times that plus beta C (plus the bias)
// for the first slice, plus alpha times the sum of each later slice; the slices depend on K and
// KC only, so the result does not depend on the thread count or on where a tile starts.
#pragma once

#include <cstdint>
#include <vector>

namespace kuai::cpu {

// C(M,N) = alpha op(A)(M,K) op(B)(K,N) + beta C (+ bias(N) on every row when bias is not null),
// row-major with cpu::gemm's transposes and leading dimensions. beta == 0 ignores C's contents.
// Threaded over the OpenMP team outside parallel regions, on the calling thread inside one.
void gemm_blocked(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc, const float* bias = nullptr);

// The scratch gemm_blocked takes for this product here (bytes of each of its allocations, from
// the tracking allocator or the calling thread's ScratchRegion): a compiled step's memory plan
// sets it aside for the product's node. alpha == 0 takes none (not modelled: callers plan for
// the product).
std::vector<int64_t> gemm_blocked_scratch_bytes(bool trans_a, bool trans_b, int64_t M, int64_t N,
                                                int64_t K);

// The blocking in force at the tier in force: the register tile (MR x NR) and the block sizes.
struct BlockedGemmBlocking {
  int64_t mr = 0, nr = 0, mc = 0, kc = 0, nc = 0;
};
BlockedGemmBlocking blocked_gemm_blocking();
// Testing hook: block sizes forced (0 keeps the derived one); small values reach every blocking
// edge on small products. MC is rounded up to a multiple of MR and NC to a multiple of NR.
void set_blocked_gemm_blocking(int64_t mc, int64_t kc, int64_t nc);

}  // namespace kuai::cpu
