// Dense fp32 matrix multiply for the CPU backend: the single entry point every matmul, linear and
// batched matmul goes through. Row-major, BLAS-style transposes and leading dimensions. Each call
// runs on oneDNN's matmul primitive, on OpenBLAS or on kuai's own blocked GEMM (blocked.h),
// whichever the router (router.h) measured fastest for the product's shape on this machine.
// gemm_reference is the naive oracle the tests compare against.
#pragma once

#include <cstdint>
#include <vector>

namespace kuai::cpu {

enum class GemmBackend { kAuto, kOpenBLAS, kOneDNN, kKuai };

// Force a backend (tests, benchmarks); kAuto restores the measured choice.
void set_gemm_backend(GemmBackend backend);
GemmBackend gemm_backend();

// C(M,N) = alpha * op(A)(M,K) @ op(B)(K,N) + beta * C, all row-major.
// op(A) = A (M,K) with row stride lda when !trans_a, else A is (K,M) with row stride lda.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// C(M,N) = op(A) @ op(B) + bias(N) on every row. oneDNN and kuai's blocked GEMM add the bias in
// their epilogues (no extra pass over C); OpenBLAS gets C pre-filled with the bias and beta = 1.
void gemm_bias(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
               int64_t lda, const float* B, int64_t ldb, const float* bias, float* C, int64_t ldc);

// `batch` independent products; matrix i uses A + a_off[i], B + b_off[i], C + c_off[i]
// (offsets in elements). Parallel over the batch when the matrices are small.
void gemm_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const int64_t* a_off, const float* B, int64_t ldb,
                  const int64_t* b_off, float beta, float* C, int64_t ldc, const int64_t* c_off,
                  int64_t batch);

// The same product on oneDNN as a sequence of slices of K (of about `slice` each, multiples of
// 64), each accumulating into C: the router's candidates "onednn_k1024" and "onednn_k4096" for
// products with a long K (gemm.cpp says why).
void gemm_split_k(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc, int64_t slice);

// The scratch (bytes of each allocation) an fp32 product of this shape takes here from the
// tracking allocator when kuai's blocked GEMM runs it: forced, or the choice the tuning cache
// holds for the shape; none otherwise (oneDNN's scratchpad is small and not counted, OpenBLAS
// keeps its own buffers). `op` is "gemm" or "bias" as the router keys them. For a memory plan
// made on meta tensors (the compiled step's), which runs no product.
std::vector<int64_t> gemm_scratch_bytes(const char* op, bool trans_a, bool trans_b, int64_t M,
                                        int64_t N, int64_t K);

// Naive triple loop in double accumulation: the oracle.
void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                    int64_t ldc);

}  // namespace kuai::cpu
