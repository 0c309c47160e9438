// Mixed-precision matrix multiply for the CPU backend: operands stored as bf16, f16 or f32, the
// product always accumulated in fp32, C written as f32 or rounded (nearest even) to bf16/f16.
// Three implementations: widen the operands to fp32 block by block (bounded scratch, accounted by
// kuai::Allocator) and run the fast fp32 gemm (gemm.h) on each block; widen them while packing
// (packed.h); or hand the low-precision operands to oneDNN's bf16/f16 matmul, which is only fast
// on CPUs with native bf16 arithmetic (AVX512-BF16, AMX). kAuto lets the router (router.h)
// measure which is fastest for each product here. gemm_lowp_reference is the naive oracle the
// tests compare against.
#pragma once

#include <cstdint>
#include <string>

#include "kuai/core/dtype.h"

namespace kuai::cpu {

enum class LowpGemmPath {
  kAuto,         // measured per product by the router; lowp_gemm_auto_path() where nothing is
  kConvertFp32,  // widen A, B (and a low-precision C) panel by panel to bounded fp32 scratch,
                 // cpu::gemm per block, round C back once if low precision
  kOneDNN,       // oneDNN matmul on the low-precision operands (falls back to kConvertFp32 for
                 // dtype combinations oneDNN cannot build a primitive for, e.g. bf16 x f16)
  kPacked,       // gemm_packed.h: widen while packing, fp32 micro-kernel, C rounded in registers
                 // (falls back to kConvertFp32 on CPUs without AVX2, FMA and F16C)
};

// Force a path (tests, benchmarks); kAuto restores the automatic choice.
void set_lowp_gemm_path(LowpGemmPath path);
LowpGemmPath lowp_gemm_path();

// kConvertFp32 blocks the product so that each widened fp32 panel (of op(A), of op(B), and of a
// low-precision C) holds at most this many floats: its scratch is at most 3 x budget x 4 bytes
// (48 MiB by default), taken from kuai::Allocator (so the peak counters see it) and released
// before gemm_lowp returns. fp32 operands are read in place and cost no scratch. Block sizes
// depend only on the shapes, the dtypes and this budget, never on the thread count. A testing
// hook: a small budget forces blocking of M, N and K on small products; 0 restores the default
// (1 << 22 floats, 16 MiB). Read once per call.
void set_lowp_gemm_panel_budget(int64_t floats);
int64_t lowp_gemm_panel_budget();  // the budget in force, in floats

// The path kAuto resolves to on this CPU.
LowpGemmPath lowp_gemm_auto_path();

// True when the tier in force (isa.h) has native bf16 dot products and oneDNN runs them
// (its effective ISA includes avx512_core_bf16 or AMX).
bool cpu_has_native_bf16();

// C(M,N) = alpha * op(A)(M,K) @ op(B)(K,N) + beta * C, all row-major, transposes and leading
// dimensions exactly as cpu::gemm (gemm.h). A, B: kF32, kBF16 or kF16 each (they may differ); C:
// kF32, kBF16 or kF16. Accumulation is fp32; a low-precision C is read (when beta != 0) widened
// and written rounded to nearest even. beta == 0 ignores C's contents (NaN garbage included).
void gemm_lowp(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype, int64_t ldb,
               float beta, void* C, DType c_dtype, int64_t ldc);

// C(M,N) = op(A) @ op(B) + bias(N) on every row, rounded once into C (the bias is added to the
// fp32 accumulator, not to a rounded product). bias: kF32, kBF16 or kF16.
void gemm_lowp_bias(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
                    DType a_dtype, int64_t lda, const void* B, DType b_dtype, int64_t ldb,
                    const void* bias, DType bias_dtype, void* C, DType c_dtype, int64_t ldc);

// For products whose A is an fp32 intermediate and whose B is stored in bf16 (attention's
// probabilities and their gradient times v, k, q or dy): where bf16 products are much faster
// than fp32 ones, op(A) is rounded to bf16 (nearest even) first, as FlashAttention rounds its
// probabilities, so that the product runs bf16 x bf16 on the native units instead of widening B
// to fp32; elsewhere, and for any other B dtype, it is gemm_lowp itself. The rounded copy comes
// from the tracking allocator for the call.
//
// "Much faster" is the amx tier (AMX tiles: ~5x the fp32 rate). With AVX512-BF16 dot products
// alone, oneDNN 2.6's bf16 matmul ran at 80-86 GFLOP/s against 280 for fp32 on an Emerald Rapids
// VM without AMX (2 threads, the tiny model's products, `kuai tune`), so rounding would cost
// accuracy and time there. The rounding changes results, so it follows the tier, never a timing.
void gemm_lowp_round_a(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t lda, const void* B, DType b_dtype, int64_t ldb,
                       float beta, void* C, DType c_dtype, int64_t ldc);
// True when gemm_lowp_round_a rounds A for a B of this dtype on this CPU and tier.
bool lowp_rounds_a(DType b_dtype);
// Testing hook: force the rounding on or off on any CPU (the product then runs bf16 x bf16 on
// whatever gemm_lowp picks, with the same numbers as on AMX up to fp32 summation order); reset
// restores the tier's choice.
void set_lowp_rounds_a(bool on);
void reset_lowp_rounds_a();

// oneDNN's implementation name for this product ("brg:avx512_core_amx", "ref:any", ...), or ""
// when oneDNN cannot build the primitive (kOneDNN then falls back to kConvertFp32).
std::string lowp_onednn_impl(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             DType a_dtype, int64_t lda, DType b_dtype, int64_t ldb, DType c_dtype,
                             int64_t ldc);

// Naive triple loop in double accumulation over the widened operands; the result is rounded to
// float and then to c_dtype. The oracle.
void gemm_lowp_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype,
                         int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc);

}  // namespace kuai::cpu
