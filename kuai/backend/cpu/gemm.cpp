// fp32 GEMM for the CPU backend: routes each product to oneDNN's matmul primitive or to OpenBLAS
// (cblas_sgemm), whichever bench/bench_gemm.cpp measured faster for its shape class; also the
// batched form used by attention and the double-accumulated reference the tests trust.
#include "kuai/backend/cpu/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <unordered_map>

#include "kuai/backend/cpu/onednn_matmul.h"

namespace kuai::cpu {
namespace {

std::atomic<GemmBackend> g_backend{GemmBackend::kAuto};

// Products of at most this many multiply-adds (M*N*K) run one per thread, in parallel over the
// batch, in gemm_batched; larger ones are threaded one at a time. No crossover was found up to the
// largest measured size (BM_BatchedCrossover, 16 square NN products, best GFLOP/s, 2 threads):
//   n                                 32    64   128   256   512
//   oneDNN    loop of threaded         27    84    54   138    36
//   oneDNN    parallel over batch      49   132   169   165    80
//   OpenBLAS  loop of threaded         45    61    51    96    34
//   OpenBLAS  parallel over batch      81   120   123   139    83
// so the bound sits at 512^3; beyond it a single product already keeps both cores busy.
constexpr int64_t kSmallProductMacs = int64_t{512} * 512 * 512;

// Measured backend choice, median GFLOP/s of 3 repetitions on a quiet machine (2-core AMD EPYC,
// AVX2+FMA, no AVX-512; OMP_NUM_THREADS=2; oneDNN 2.6, Debian OpenBLAS-openmp 0.3.21):
//   OMP_NUM_THREADS=2 build/kuai_bench_ops --benchmark_filter='BM_Gemm/.*/(onednn|openblas)'
//     --benchmark_min_time=0.3 --benchmark_repetitions=3
// The 2048^3 ceiling is 168 GFLOP/s. Shapes are (M,N,K) of the product as gemm sees it.
//   pass    product                     tiny (4096 rows)           GPT-2 124M (1024 rows)
//                                       oneDNN / OpenBLAS           oneDNN / OpenBLAS
//   fwd NT  qkv                         154 / 155                   166 / 165
//           proj                        150 / 134                   161 / 152
//           fc                          162 / 144                   163 / 162
//           fc_proj                     135 / 136                   162 / 154
//           lm_head                         -                       165 / 164
//   dX  NN  qkv                         151 / 126                   165 / 152
//           proj                        151 / 107                   160 / 143
//           fc                          135 / 126                   162 / 152
//           fc_proj                     168 / 139                   167 / 159
//           lm_head                         -                       167 / 166
//   dW  TN  qkv  (768,256,4096)         117 / 124   (768,2304,1024) 165 / 154
//           proj (256,256,4096)         115 / 120                   160 / 150
//           fc   (1024,256,4096)         66 / 126                   155 / 155
//           fc_proj (256,1024,4096)      64 / 142                   164 / 164
//           lm_head (50257,768,1024)        -                       159 / 164
//   attention, one product per thread over the batch (an earlier, noisier run):
//   scores NT (256,256,64) x48 | (256,256,32) x128     148 | 120   120 | 98
//   values NN (256,64,256) x48                         129         121
//   dV     TN (256,64,256) x48                         143         116
// oneDNN wins or ties everywhere except the weight gradients whose reduction (K, the token
// count) is long against the output (tiny's dW: K = 4096 over a 256..1024-wide result), where
// its TN kernel falls to 64 GFLOP/s and OpenBLAS keeps 142. TT (unused by training) follows TN.
GemmBackend measured_backend(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             bool batched) {
  if (batched && M * N * K <= kSmallProductMacs) return GemmBackend::kOneDNN;
  if (trans_a && K > 2 * std::max(M, N)) return GemmBackend::kOpenBLAS;
  return GemmBackend::kOneDNN;
}

GemmBackend resolve_backend(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                            bool batched) {
  const GemmBackend forced = g_backend.load(std::memory_order_relaxed);
  if (forced != GemmBackend::kAuto) return forced;
  return measured_backend(trans_a, trans_b, M, N, K, batched);
}

// The fp32 oneDNN primitive for this product (oneDNN implements every fp32 matmul).
const OneDnnMatmul& fp32_matmul(OneDnnMatmulKey key, std::shared_ptr<const OneDnnMatmul>& hold) {
  hold = cached_onednn_matmul(key);
  if (!hold) throw std::runtime_error("oneDNN: no fp32 matmul implementation");
  return *hold;
}

OneDnnMatmulKey matmul_key(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                           int64_t lda, int64_t ldb, float beta, int64_t ldc) {
  return onednn_matmul_key(trans_a, trans_b, M, N, K, alpha, DType::kF32, lda, DType::kF32, ldb,
                           beta, DType::kF32, ldc);
}

void run_openblas(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc) {
  // OpenBLAS's OpenMP build runs single-threaded when called inside a parallel region.
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(M), static_cast<blasint>(N),
              static_cast<blasint>(K), alpha, A, static_cast<blasint>(lda), B,
              static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

// C = beta * C for the degenerate products (K == 0 or alpha == 0); beta == 0 writes zeros so
// NaN garbage in C is ignored, as BLAS does.
void scale_c(int64_t M, int64_t N, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    float* row = C + i * ldc;
    for (int64_t j = 0; j < N; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
  }
}

// True when the product does no multiply at all and has been completed by scale_c.
bool handle_degenerate(int64_t M, int64_t N, int64_t K, float alpha, float beta, float* C,
                       int64_t ldc) {
  if (M <= 0 || N <= 0) return true;
  if (K > 0 && alpha != 0.0f) return false;
  if (beta != 1.0f) scale_c(M, N, beta, C, ldc);
  return true;
}

}  // namespace

void set_gemm_backend(GemmBackend backend) { g_backend.store(backend, std::memory_order_relaxed); }

GemmBackend gemm_backend() { return g_backend.load(std::memory_order_relaxed); }

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (handle_degenerate(M, N, K, alpha, beta, C, ldc)) return;
  if (resolve_backend(trans_a, trans_b, M, N, K, false) == GemmBackend::kOpenBLAS) {
    run_openblas(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  std::shared_ptr<const OneDnnMatmul> hold;
  run_onednn_matmul(
      fp32_matmul(matmul_key(trans_a, trans_b, M, N, K, alpha, lda, ldb, beta, ldc), hold), A, B,
      C);
}

void gemm_bias(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
               int64_t lda, const float* B, int64_t ldb, const float* bias, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  const bool onednn =
      K > 0 && resolve_backend(trans_a, trans_b, M, N, K, false) == GemmBackend::kOneDNN;
  if (onednn) {
    OneDnnMatmulKey key = matmul_key(trans_a, trans_b, M, N, K, 1.0f, lda, ldb, 0.0f, ldc);
    key.bias = true;
    std::shared_ptr<const OneDnnMatmul> hold;
    run_onednn_matmul(fp32_matmul(key, hold), A, B, C, bias);
    return;
  }
#pragma omp parallel for schedule(static) if (M * N > (1 << 16))
  for (int64_t i = 0; i < M; ++i) std::copy(bias, bias + N, C + i * ldc);
  gemm(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, ldc);
}

void gemm_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const int64_t* a_off, const float* B, int64_t ldb,
                  const int64_t* b_off, float beta, float* C, int64_t ldc, const int64_t* c_off,
                  int64_t batch) {
  if (batch <= 0) return;
  const bool parallel_over_batch = batch > 1 && !omp_in_parallel() && omp_get_max_threads() > 1 &&
                                   M * N * K <= kSmallProductMacs;
  if (!parallel_over_batch) {
    for (int64_t i = 0; i < batch; ++i) {
      gemm(trans_a, trans_b, M, N, K, alpha, A + a_off[i], lda, B + b_off[i], ldb, beta,
           C + c_off[i], ldc);
    }
    return;
  }
  if (M <= 0 || N <= 0) return;
  // Resolve the backend and the single-threaded primitive once, outside the parallel region.
  const bool degenerate = K <= 0 || alpha == 0.0f;
  const GemmBackend backend = resolve_backend(trans_a, trans_b, M, N, K, true);
  std::shared_ptr<const OneDnnMatmul> mm;
  if (!degenerate && backend == GemmBackend::kOneDNN) {
    OneDnnMatmulKey key = matmul_key(trans_a, trans_b, M, N, K, alpha, lda, ldb, beta, ldc);
    key.threads = 1;  // one product per thread
    fp32_matmul(key, mm);
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < batch; ++i) {
    float* c = C + c_off[i];
    if (degenerate) {
      handle_degenerate(M, N, K, alpha, beta, c, ldc);
    } else if (mm) {
      run_onednn_matmul(*mm, A + a_off[i], B + b_off[i], c);
    } else {
      run_openblas(trans_a, trans_b, M, N, K, alpha, A + a_off[i], lda, B + b_off[i], ldb, beta, c,
                   ldc);
    }
  }
}

void gemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                    int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t p = 0; p < K; ++p) {
        const double a = trans_a ? A[p * lda + i] : A[i * lda + p];
        const double b = trans_b ? B[j * ldb + p] : B[p * ldb + j];
        acc += a * b;
      }
      float* c = C + i * ldc + j;
      const double prior = beta == 0.0f ? 0.0 : static_cast<double>(beta) * *c;
      *c = static_cast<float>(static_cast<double>(alpha) * acc + prior);
    }
  }
}

}  // namespace kuai::cpu
