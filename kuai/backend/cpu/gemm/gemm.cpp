// fp32 GEMM for the CPU backend: each product runs on oneDNN's matmul primitive, on OpenBLAS
// (cblas_sgemm) or on kuai's blocked GEMM (blocked.h), as the router (router.h) chooses; also the
// batched form used by attention and the double-accumulated reference the tests trust.
#include "kuai/backend/cpu/gemm/gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>

#include "kuai/backend/cpu/gemm/blocked.h"
#include "kuai/backend/cpu/gemm/libraries.h"
#include "kuai/backend/cpu/gemm/onednn.h"
#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/gemm/tuning.h"

namespace kuai::cpu {
namespace {

std::atomic<GemmBackend> g_backend{GemmBackend::kAuto};

// gemm_batched runs products of at most this many multiply-adds (M*N*K) one per thread, in
// parallel over the batch, when the router finds that faster than threading each product in
// turn (it measures both); larger products always run one at a time, threaded, since one of them
// already keeps every core busy.
constexpr int64_t kSmallProductMacs = int64_t{512} * 512 * 512;

// A product with a long K is also offered to the router as a sequence of K slices, each
// accumulating into C (the caller's beta for the first, 1 after), at each slice size below that
// K holds at least twice. On 2 threads of an AMD Zen 5, oneDNN 2.6 ran the input gradients of
// GPT-2's projections (NN, 1024 x 768 x 2304 and x 3072) at 254-260 GFLOP/s whole and 349-366 in
// slices of 1024, and the lm_head's (1024 x 768 x 50257) at 217 whole and 363 in slices of 4096,
// while NT products ran slower sliced; the router measures which wins on the machine at hand.
struct SplitK {
  const char* name;
  int64_t slice;
};
constexpr SplitK kSplitKCandidates[] = {{"onednn_k1024", 1024}, {"onednn_k4096", 4096}};

// The slices of K for a target size: as equal as possible, each a multiple of 64 but the last.
int64_t split_k_slice(int64_t K, int64_t target) {
  const int64_t n = (K + target - 1) / target;
  return ((K + n - 1) / n + 63) / 64 * 64;
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
  configure_gemm_libraries();  // OpenBLAS's kernel core set to the tier in force
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

// Runs the product on the forced backend, else on the router's choice among oneDNN, OpenBLAS,
// kuai's blocked GEMM and, when `split_k` is given, oneDNN over slices of K (kSplitKCandidates).
// `snapshot` keeps a C that the product reads (beta != 0) while the router measures.
void run_routed(const GemmShape& shape, const std::function<void()>& onednn,
                const std::function<void()>& openblas, const std::function<void()>& blocked,
                MatrixSnapshot* snapshot = nullptr,
                const std::function<void(int64_t)>& split_k = {}) {
  GemmBackend backend = gemm_backend();
  if (backend == GemmBackend::kAuto) {
    GemmCandidate candidates[3 + std::size(kSplitKCandidates)] = {
        {"onednn", onednn}, {"openblas", openblas}, {"kuai", blocked}};
    size_t n = 3;
    for (const SplitK& sk : kSplitKCandidates)
      if (split_k && shape.k >= 2 * sk.slice)
        candidates[n++] = {sk.name, [&split_k, slice = sk.slice] { split_k(slice); }};
    const std::span<const GemmCandidate> offered(candidates, n);
    const size_t i = snapshot != nullptr
                         ? route(shape, offered, 0, snapshot->save_fn(), snapshot->restore_fn())
                         : route(shape, offered, 0);
    return run_profiled(shape, candidates[i].name, candidates[i].run);
  }
  if (backend == GemmBackend::kOpenBLAS)
    run_profiled(shape, "openblas", openblas);
  else if (backend == GemmBackend::kKuai)
    run_profiled(shape, "kuai", blocked);
  else
    run_profiled(shape, "onednn", onednn);
}

}  // namespace

void set_gemm_backend(GemmBackend backend) { g_backend.store(backend, std::memory_order_relaxed); }

GemmBackend gemm_backend() { return g_backend.load(std::memory_order_relaxed); }

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (handle_degenerate(M, N, K, alpha, beta, C, ldc)) return;
  auto onednn = [&] {
    std::shared_ptr<const OneDnnMatmul> hold;
    run_onednn_matmul(
        fp32_matmul(matmul_key(trans_a, trans_b, M, N, K, alpha, lda, ldb, beta, ldc), hold), A, B,
        C);
  };
  auto blocked = [&] {
    gemm_blocked(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  };
  // Where the router takes its default (oneDNN) unless another backend is forced, the small
  // per-thread products (attention's tiles) go straight there, without building the candidates
  // (~0.5-1 us a call).
  if (routes_to_default_here()) {
    const GemmBackend forced = gemm_backend();
    if (forced == GemmBackend::kKuai) return blocked();
    if (forced != GemmBackend::kOpenBLAS) return onednn();
  }
  auto openblas = [&] {
    run_openblas(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  };
  auto split_k = [&](int64_t slice) {
    gemm_split_k(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, slice);
  };
  MatrixSnapshot snapshot(beta != 0.0f ? C : nullptr, M, N, ldc, sizeof(float));
  run_routed({"gemm", trans_a, trans_b, M, N, K}, onednn, openblas, blocked, &snapshot, split_k);
}

void gemm_split_k(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc, int64_t slice) {
  if (handle_degenerate(M, N, K, alpha, beta, C, ldc)) return;
  // C = alpha op(A)[:, k0:k0+kn] op(B)[k0:k0+kn, :] + beta' C, slice after slice (beta' = the
  // caller's beta for the first, 1 after).
  const int64_t kc = split_k_slice(K, std::max<int64_t>(slice, 1));
  for (int64_t k0 = 0; k0 < K; k0 += kc) {
    const int64_t kn = std::min(kc, K - k0);
    std::shared_ptr<const OneDnnMatmul> hold;
    run_onednn_matmul(fp32_matmul(matmul_key(trans_a, trans_b, M, N, kn, alpha, lda, ldb,
                                             k0 == 0 ? beta : 1.0f, ldc),
                                  hold),
                      trans_a ? A + k0 * lda : A + k0, trans_b ? B + k0 : B + k0 * ldb, C);
  }
}

void gemm_bias(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const float* A,
               int64_t lda, const float* B, int64_t ldb, const float* bias, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  auto onednn = [&] {
    OneDnnMatmulKey key = matmul_key(trans_a, trans_b, M, N, K, 1.0f, lda, ldb, 0.0f, ldc);
    key.bias = true;
    std::shared_ptr<const OneDnnMatmul> hold;
    run_onednn_matmul(fp32_matmul(key, hold), A, B, C, bias);
  };
  auto openblas = [&] {  // C pre-filled with the bias rows, then C += A B
#pragma omp parallel for schedule(static) if (M * N > (1 << 16) && !omp_in_parallel())
    for (int64_t i = 0; i < M; ++i) std::copy(bias, bias + N, C + i * ldc);
    run_openblas(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, C, ldc);
  };
  auto blocked = [&] {
    gemm_blocked(trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, ldc, bias);
  };
  if (K <= 0) {  // no product: the bias rows
    for (int64_t i = 0; i < M; ++i) std::copy(bias, bias + N, C + i * ldc);
    return;
  }
  run_routed({"bias", trans_a, trans_b, M, N, K}, onednn, openblas, blocked);  // C is not read
}

void gemm_batched(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const int64_t* a_off, const float* B, int64_t ldb,
                  const int64_t* b_off, float beta, float* C, int64_t ldc, const int64_t* c_off,
                  int64_t batch) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  // One product after another, each threaded (and routed) by gemm().
  auto loop = [&] {
    for (int64_t i = 0; i < batch; ++i) {
      gemm(trans_a, trans_b, M, N, K, alpha, A + a_off[i], lda, B + b_off[i], ldb, beta,
           C + c_off[i], ldc);
    }
  };
  const bool may_parallelize = batch > 1 && !omp_in_parallel() && omp_get_max_threads() > 1 &&
                               M * N * K <= kSmallProductMacs && K > 0 && alpha != 0.0f;
  if (!may_parallelize) {
    loop();
    return;
  }
  // One single-threaded product per thread, in parallel over the batch; the primitive is
  // created once, outside the parallel region, and executed by every thread (each execution
  // brings its own scratchpad: onednn.h).
  std::shared_ptr<const OneDnnMatmul> mm;
  auto parallel_onednn = [&] {
    if (!mm) {
      OneDnnMatmulKey key = matmul_key(trans_a, trans_b, M, N, K, alpha, lda, ldb, beta, ldc);
      key.threads = 1;
      fp32_matmul(key, mm);
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; ++i)
      run_onednn_matmul(*mm, A + a_off[i], B + b_off[i], C + c_off[i]);
  };
  auto parallel_openblas = [&] {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; ++i) {
      run_openblas(trans_a, trans_b, M, N, K, alpha, A + a_off[i], lda, B + b_off[i], ldb, beta,
                   C + c_off[i], ldc);
    }
  };
  auto parallel_blocked = [&] {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < batch; ++i) {
      gemm_blocked(trans_a, trans_b, M, N, K, alpha, A + a_off[i], lda, B + b_off[i], ldb, beta,
                   C + c_off[i], ldc);
    }
  };
  const GemmBackend forced = gemm_backend();
  if (forced == GemmBackend::kOneDNN) return parallel_onednn();
  if (forced == GemmBackend::kOpenBLAS) return parallel_openblas();
  if (forced == GemmBackend::kKuai) return parallel_blocked();
  const GemmCandidate candidates[] = {
      {"onednn", parallel_onednn}, {"openblas", parallel_openblas}, {"loop", loop}};
  // C is read when beta != 0: calibrate only products that overwrite it (attention's).
  const GemmShape shape{"batched", trans_a, trans_b, M, N, K, batch};
  const size_t i = beta == 0.0f ? route(shape, candidates, 0) : 0;
  run_profiled(shape, candidates[i].name, candidates[i].run);
}

std::vector<int64_t> gemm_scratch_bytes(const char* op, bool trans_a, bool trans_b, int64_t M,
                                        int64_t N, int64_t K) {
  if (M <= 0 || N <= 0 || K <= 0) return {};
  bool blocked = gemm_backend() == GemmBackend::kKuai;
  if (gemm_backend() == GemmBackend::kAuto && !routes_to_default_here()) {
    TuningCache& cache = TuningCache::get();
    blocked = cache.enabled() && cache.find(routing_key({op, trans_a, trans_b, M, N, K})) == "kuai";
  }
  if (!blocked) return {};
  return gemm_blocked_scratch_bytes(trans_a, trans_b, M, N, K);
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
