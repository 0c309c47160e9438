// Naive attention per head with causal block skipping (see attention.h). Every product goes
// through cpu::gemm (fp32 operands), the small GEMM (fp32, where it measured faster:
// block_products.h) or gemm_lowp (bf16/f16 operands), called from inside the caller's parallel
// loop over heads, where it runs on one thread.
#include "kuai/backend/cpu/attention.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/backend/cpu/gemm/small_gemm.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/parallel_chunks.h"

namespace kuai::cpu {
namespace {

// Row r, column c of a row-major matrix of dtype t with row stride ld.
const void* at(const void* base, DType t, int64_t ld, int64_t r, int64_t c = 0) {
  return static_cast<const char*>(base) + (r * ld + c) * dtype_size(t);
}
void* at(void* base, DType t, int64_t ld, int64_t r, int64_t c = 0) {
  return static_cast<char*>(base) + (r * ld + c) * dtype_size(t);
}

// C = alpha op(A) op(B), beta 0: the fp32 gemm when all three are fp32, else gemm_lowp; an fp32
// A (probabilities, their gradient) against bf16 B is rounded to bf16 where bf16 products are
// much faster (gemm_lowp_round_a), so every product of a bf16 head runs on the native units.
// With `small` (fp32 heads, op(B) never transposed: the caller passes k or v transposed), the
// product runs on the small GEMM.
void product(bool small, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
             const void* A, DType at_, int64_t lda, const void* B, DType bt, int64_t ldb, void* C,
             DType ct, int64_t ldc) {
  if (small) {
    small_gemm(ta, tb, M, N, K, alpha, static_cast<const float*>(A), lda,
               static_cast<const float*>(B), ldb, 0.0f, static_cast<float*>(C), ldc, nullptr);
  } else if (at_ == DType::kF32 && bt == DType::kF32 && ct == DType::kF32) {
    gemm(ta, tb, M, N, K, alpha, static_cast<const float*>(A), lda, static_cast<const float*>(B),
         ldb, 0.0f, static_cast<float*>(C), ldc);
  } else if (at_ == DType::kF32) {
    gemm_lowp_round_a(ta, tb, M, N, K, alpha, static_cast<const float*>(A), lda, B, bt, ldb, 0.0f,
                      C, ct, ldc);
  } else {
    gemm_lowp(ta, tb, M, N, K, alpha, A, at_, lda, B, bt, ldb, 0.0f, C, ct, ldc);
  }
}

constexpr DType kF32 = DType::kF32;

}  // namespace

void attention_head_forward(const TypedHeadView& h, float* p, void* y, int64_t ldy, int64_t T,
                            int64_t d, float scale, bool causal, float* s, float* bt) {
  const int64_t B = kAttentionBlock;
  const DType t = h.t;
  const bool small = bt != nullptr && t == kF32;
  if (small) transpose_floats(static_cast<const float*>(h.k), h.ldk, T, d, bt, T);  // k^T (d, T)
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;  // keys this query block can see
    // s[r0:r0+rn, 0:cols] = scale * q_blk k[0:cols]^T   (rn, cols)
    if (small)
      product(true, false, false, rn, cols, d, scale, at(h.q, t, h.ldq, r0), t, h.ldq, bt, kF32, T,
              s + r0 * T, kF32, T);
    else
      product(false, false, true, rn, cols, d, scale, at(h.q, t, h.ldq, r0), t, h.ldq, h.k, t,
              h.ldk, s + r0 * T, kF32, T);
  }
  softmax_forward(s, p, T, T, 1.0f, causal);  // reads only the unmasked entries; zeros the rest
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;
    // y_blk = p[r0:r0+rn, 0:cols] v[0:cols]   (rn, d)
    product(small, false, false, rn, d, cols, 1.0f, p + r0 * T, kF32, T, h.v, t, h.ldv,
            at(y, t, ldy, r0), t, ldy);
  }
}

void attention_head_backward(const TypedHeadView& h, const float* p, const void* dy, int64_t lddy,
                             void* dq, int64_t lddq, void* dk, int64_t lddk, void* dv, int64_t lddv,
                             int64_t T, int64_t d, float scale, bool causal, float* dp, float* bt) {
  const int64_t B = kAttentionBlock;
  const DType t = h.t;
  const bool small = bt != nullptr && t == kF32;
  if (small) transpose_floats(static_cast<const float*>(h.v), h.ldv, T, d, bt, T);  // v^T (d, T)
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;
    // dp_blk = dy_blk v[0:cols]^T   (rn, cols); the masked rest of the rows is zero
    if (small)
      product(true, false, false, rn, cols, d, 1.0f, at(dy, t, lddy, r0), t, lddy, bt, kF32, T,
              dp + r0 * T, kF32, T);
    else
      product(false, false, true, rn, cols, d, 1.0f, at(dy, t, lddy, r0), t, lddy, h.v, t, h.ldv,
              dp + r0 * T, kF32, T);
  }
  // ds = scale * p * (dp - rowsum(p * dp)), in place over dp, over the keys each row block
  // computed (masked entries among them: p = 0, so 0); the products below read no other entry.
  const int64_t blocks = (T + B - 1) / B;
  auto softmax_block = [&](int64_t b) {
    const int64_t r0 = b * B, rn = std::min(B, T - r0);
    softmax_backward_serial(p + r0 * T, dp + r0 * T, dp + r0 * T, rn, causal ? r0 + rn : T, T,
                            scale);
  };
  parallel_tasks(blocks, true, softmax_block);  // inline inside the caller's loop over heads
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;
    // dq_blk = ds[r0:r0+rn, 0:cols] k[0:cols]   (rn, d)
    product(small, false, false, rn, d, cols, 1.0f, dp + r0 * T, kF32, T, h.k, t, h.ldk,
            at(dq, t, lddq, r0), t, lddq);
  }
  for (int64_t c0 = 0; c0 < T; c0 += B) {
    const int64_t cn = std::min(B, T - c0);
    const int64_t first = causal ? c0 : 0;  // queries that see this key block
    const int64_t rows = T - first;
    // dk_blk = ds[first:T, c0:c0+cn]^T q[first:T]   (cn, d)
    product(small, true, false, cn, d, rows, 1.0f, dp + first * T + c0, kF32, T,
            at(h.q, t, h.ldq, first), t, h.ldq, at(dk, t, lddk, c0), t, lddk);
    // dv_blk = p[first:T, c0:c0+cn]^T dy[first:T]   (cn, d)
    product(small, true, false, cn, d, rows, 1.0f, p + first * T + c0, kF32, T,
            at(dy, t, lddy, first), t, lddy, at(dv, t, lddv, c0), t, lddv);
  }
}

void attention_head_forward(const HeadView& h, float* p, float* y, int64_t ldy, int64_t T,
                            int64_t d, float scale, bool causal, float* s, float* bt) {
  attention_head_forward(TypedHeadView{h.q, h.k, h.v, h.ldq, h.ldk, h.ldv, kF32}, p, y, ldy, T, d,
                         scale, causal, s, bt);
}

void attention_head_backward(const HeadView& h, const float* p, const float* dy, int64_t lddy,
                             float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                             int64_t lddv, int64_t T, int64_t d, float scale, bool causal,
                             float* dp, float* bt) {
  attention_head_backward(TypedHeadView{h.q, h.k, h.v, h.ldq, h.ldk, h.ldv, kF32}, p, dy, lddy, dq,
                          lddq, dk, lddk, dv, lddv, T, d, scale, causal, dp, bt);
}

namespace {

// Heads of random operands at T (contiguous (T, d) each) and their buffers, for the
// measurement of the products: forward and backward of every head, in parallel over heads as the
// model's ops run them.
struct NaiveTrial {
  int64_t T, nh, d;
  std::vector<float> ops, p, work;

  NaiveTrial(int64_t T_, int64_t nh_, int64_t d_) : T(T_), nh(nh_), d(d_) {
    const int64_t n = nh * T * d;
    ops.assign(static_cast<size_t>(8 * n), 0.0f);
    std::mt19937 rng(37);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < 4 * n; ++i) ops[i] = normal(rng);
    p.assign(static_cast<size_t>(nh * T * T), 0.0f);
    work.assign(static_cast<size_t>(nh * (T * T + d * T)), 0.0f);
  }
  void run(bool small) {
    const int64_t n = nh * T * d;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < nh; ++h) {
      const float *q = ops.data() + h * T * d, *k = q + n, *v = k + n, *dy = v + n;
      float *y = ops.data() + 4 * n + h * T * d, *dq = y + n, *dk = dq + n, *dv = dk + n;
      float* s = work.data() + h * (T * T + d * T);
      float* bt = small ? s + T * T : nullptr;
      const HeadView hv{q, k, v, d, d, d};
      attention_head_forward(hv, p.data() + h * T * T, y, d, T, d, scale, true, s, bt);
      attention_head_backward(hv, p.data() + h * T * T, dy, d, dq, d, dk, d, dv, d, T, d, scale,
                              true, s, bt);
    }
  }
};

}  // namespace

BlockProducts naive_attention_products(int64_t T_call, int64_t d) {
  const int64_t T = block_products_bucket(T_call, 64, 2048);
  const int64_t nh = 2 * std::max(1, omp_get_max_threads());
  return measured_block_products(
      fmt::format("naive products d{} T{} t{}", d, T, omp_get_max_threads()),
      fmt::format("forward and backward at T {}, {} heads", T, nh), [&]() -> BlockProductsRun {
        auto trial = std::make_shared<NaiveTrial>(T, nh, d);
        return [trial](BlockProducts products) { trial->run(products == BlockProducts::kSmall); };
      });
}

}  // namespace kuai::cpu
