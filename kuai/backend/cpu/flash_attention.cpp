// The CPU flash-attention kernels (see flash_attention.h). Forward: per query block, the scores
// of each key block come from one small GEMM, the online-softmax update rescales the running sums
// and the accumulator, and the block's probabilities are multiplied into the accumulator by a
// second GEMM. Backward: the probabilities of a block pair are recomputed from lse; key_block()
// does a key block's dk and dv (and, in the one-head-per-thread schedule, its part of dq),
// query_block() a query block's dq (the second pass of the split schedule); its fp32 products run
// on the GEMM libraries or on the register-blocked small GEMM, whichever this machine measured
// faster (flash_products()). The row loops are KUAI_CLONE kernels, so exp, max and the dot
// products vectorise, with fixed-lane sums.
#include "kuai/backend/cpu/flash_attention.h"
#include "kuai/backend/cpu/convert.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/backend/cpu/gemm/small_gemm.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/vec_math.h"
#include "kuai/core/allocator.h"

namespace kuai::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

constexpr int kLanes = 16;  // independent accumulators: the row sums vectorise, in a fixed order

// Sum of the lanes in a fixed pairwise order.
[[gnu::always_inline]] inline float combine_lanes(float* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  return acc[0];
}

// A NaN score is skipped here but propagates through exp and the sum.
template <int W>
KUAI_KERNEL float row_max_kernel(const float* s, int64_t n) {
  return vm::max_of<W>(s, n);
}
KUAI_CLONE_WIDTHS(row_max, row_max_kernel<8>, row_max_kernel<4>)

// p[j] = exp(s[j] - m) in place; returns their sum.
KUAI_KERNEL float exp_shifted_kernel(float* s, int64_t n, float m) {
  return vm::exp_sum(s, s, n, 1.0f, m);
}
KUAI_CLONE(exp_shifted, exp_shifted_kernel)

KUAI_KERNEL void scale_row_kernel(float* x, int64_t n, float a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}
KUAI_CLONE(scale_row, scale_row_kernel)

KUAI_KERNEL void ds_from_kernel(const float* p, const float* dp, float D, float* ds, int64_t n) {
  for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (dp[j] - D);
}
KUAI_CLONE(ds_from, ds_from_kernel)

KUAI_KERNEL float dot_kernel(const float* a, const float* b, int64_t n) {
  float lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lane[k] += a[j + k] * b[j + k];
  for (int k = 0; j + k < n; ++k) lane[k] += a[j + k] * b[j + k];
  return combine_lanes(lane);
}
KUAI_CLONE(dot, dot_kernel)

// Row r of a row-major matrix of dtype t with row stride ld.
const void* row(const void* base, DType t, int64_t ld, int64_t r) {
  return static_cast<const char*>(base) + r * ld * dtype_size(t);
}
void* row(void* base, DType t, int64_t ld, int64_t r) {
  return static_cast<char*>(base) + r * ld * dtype_size(t);
}

// C (fp32, M x N) = alpha op(A) op(B) + beta C on the calling thread. fp32 operands go to
// cpu::gemm (its library kernels measured 10-15% faster than the packed GEMM on these block
// products). bf16/f16 blocks go to gemm_lowp, whose default path inside this parallel region
// follows the tier (gemm_lowp.cpp: AMX tiles, AVX-512 fp32 after widening, or the packed AVX2
// kernel); where bf16 products are much faster (amx), an fp32 probability or gradient block is
// rounded to bf16 first, as FlashAttention does (gemm_lowp_round_a).
void product(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
             DType at, int64_t lda, const void* B, DType bt, int64_t ldb, float beta, float* C,
             int64_t ldc) {
  if (at == DType::kF32 && bt == DType::kF32)
    gemm(ta, tb, M, N, K, alpha, static_cast<const float*>(A), lda, static_cast<const float*>(B),
         ldb, beta, C, ldc);
  else if (at == DType::kF32)
    gemm_lowp_round_a(ta, tb, M, N, K, alpha, static_cast<const float*>(A), lda, B, bt, ldb, beta,
                      C, DType::kF32, ldc);
  else
    gemm_lowp(ta, tb, M, N, K, alpha, A, at, lda, B, bt, ldb, beta, C, DType::kF32, ldc);
}

// dst rows (dtype t, row stride ldd) = src (rows, cols) fp32 with row stride lds, rounded once.
void store_rows(const float* src, int64_t lds, void* dst, DType t, int64_t ldd, int64_t rows,
                int64_t cols) {
  for (int64_t i = 0; i < rows; ++i)
    convert_serial(src + i * lds, DType::kF32, row(dst, t, ldd, i), t, cols);
}

// Keys [0, n) that query row i (of tq) sees: all, or up to its position tk - tq + i.
int64_t keys_seen(const FlashParams& p, int64_t i) {
  return p.causal ? std::min(p.tk, p.tk - p.tq + i + 1) : p.tk;
}

}  // namespace

int64_t flash_forward_work_floats(int64_t d) {
  return kFlashBlockQ * kFlashBlockK + kFlashBlockQ * d + 2 * kFlashBlockQ;
}

void flash_attention_forward_rows(const FlashHead& h, int64_t r0, int64_t rn, const FlashParams& p,
                                  float* work) {
  const int64_t d = p.d;
  const DType t = p.dtype;
  float* s = work;                               // (rn, cn) scores, then probabilities
  float* acc = s + kFlashBlockQ * kFlashBlockK;  // (rn, d) unnormalised output
  float* m = acc + kFlashBlockQ * d;             // running row maximum of the scaled scores
  float* l = m + kFlashBlockQ;                   // running row sum of exp(score - m)
  std::fill(acc, acc + rn * d, 0.0f);
  std::fill(m, m + rn, kNegInf);
  std::fill(l, l + rn, 0.0f);
  const int64_t kend = keys_seen(p, r0 + rn - 1);  // keys any row of the block sees
  const void* q = row(h.q, t, h.ldq, r0);
  for (int64_t c0 = 0; c0 < kend; c0 += kFlashBlockK) {
    const int64_t cn = std::min(kFlashBlockK, kend - c0);
    // s = scale q_blk k_blk^T   (rn, cn)
    product(false, true, rn, cn, d, p.scale, q, t, h.ldq, row(h.k, t, h.ldk, c0), t, h.ldk, 0.0f, s,
            cn);
    for (int64_t i = 0; i < rn; ++i) {
      float* si = s + i * cn;
      const int64_t visible = std::clamp<int64_t>(keys_seen(p, r0 + i) - c0, 0, cn);
      std::fill(si + visible, si + cn, 0.0f);  // masked: probability 0
      if (visible == 0) continue;
      const float m_new = std::max(m[i], row_max(si, visible));
      const float alpha = std::exp(m[i] - m_new);  // 0 on the first block (m = -inf)
      l[i] = l[i] * alpha + exp_shifted(si, visible, m_new);
      if (alpha != 1.0f) scale_row(acc + i * d, d, alpha);
      m[i] = m_new;
    }
    // acc += p v_blk   (rn, d)
    product(false, false, rn, d, cn, 1.0f, s, DType::kF32, cn, row(h.v, t, h.ldv, c0), t, h.ldv,
            1.0f, acc, d);
  }
  for (int64_t i = 0; i < rn; ++i) {
    scale_row(acc + i * d, d, 1.0f / l[i]);
    h.lse[r0 + i] = m[i] + std::log(l[i]);
  }
  store_rows(acc, d, row(h.o, t, h.ldo, r0), t, h.ldo, rn, d);
}

namespace {

void check(const FlashParams& p, const char* what) {
  if (p.tq < 0 || p.tk < 0 || p.d <= 0 || (p.causal && p.tk < p.tq))
    throw std::invalid_argument(
        fmt::format("{}: needs tq, tk >= 0, d > 0 and (causal) tk >= tq; got tq {}, tk {}, d {}",
                    what, p.tq, p.tk, p.d));
}

int threads_for(int64_t items) {
  return std::max(1, static_cast<int>(std::min<int64_t>(omp_get_max_threads(), items)));
}

}  // namespace

void flash_attention_forward(std::span<const FlashHead> heads, const FlashParams& p) {
  check(p, "flash_attention_forward");
  if (heads.empty() || p.tq == 0) return;
  const int64_t blocks = (p.tq + kFlashBlockQ - 1) / kFlashBlockQ;
  const int64_t nh = static_cast<int64_t>(heads.size());
  const int64_t items = nh * blocks;
  const int threads = threads_for(items);
  const int64_t per_thread = flash_forward_work_floats(p.d);
  ScratchFloats work(per_thread * threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t it = 0; it < items; ++it) {
    // Last query blocks first: with a causal mask they cost the most.
    const int64_t item = items - 1 - it;
    const int64_t head = item % nh, r0 = item / nh * kFlashBlockQ;
    flash_attention_forward_rows(heads[head], r0, std::min(kFlashBlockQ, p.tq - r0), p,
                                 work.data() + omp_get_thread_num() * per_thread);
  }
}

namespace {

constexpr int64_t kBQ = kFlashBlockQBackward;
constexpr int64_t kBK = kFlashBlockKBackward;
constexpr int64_t kTile = kBQ * kBK;

// The backward's fp32 block products on the register-blocked small GEMM (small_gemm.h) instead of
// the libraries': the scores' and dp's products then read k and v of the key block transposed
// (kt, vt: (d, cn) with row stride cn), made once per key block, so every product is NN or TN.
struct Small {
  const float* kt = nullptr;  // null: the libraries' products
  const float* vt = nullptr;
  bool on() const { return kt != nullptr; }
};

// kt, vt (d, cn) = the key block's k and v transposed (fp32 heads only).
void transpose_block(const FlashHeadGrad& h, int64_t c0, int64_t cn, int64_t d, float* kt,
                     float* vt) {
  transpose_floats(static_cast<const float*>(h.k) + c0 * h.ldk, h.ldk, cn, d, kt, cn);
  transpose_floats(static_cast<const float*>(h.v) + c0 * h.ldv, h.ldv, cn, d, vt, cn);
}

// For query rows [r0, r0 + rn) and keys [c0, c0 + cn) of one head: pr = the probabilities
// recomputed from lse (0 where masked), then ds = pr * (dp - D) with dp = dout v^T; pr and dp
// (rn, cn) with row stride cn. The dv product needs pr before it becomes ds, so it runs here.
void block_grads(const FlashHeadGrad& h, const FlashParams& p, const float* D, int64_t r0,
                 int64_t rn, int64_t c0, int64_t cn, float* pr, float* dp, float* dv_acc,
                 const Small& sm) {
  const DType t = p.dtype;
  const void* q = row(h.q, t, h.ldq, r0);
  const void* dout = row(h.dout, t, h.lddout, r0);
  if (sm.on()) {
    const auto* qf = static_cast<const float*>(q);
    const auto* df = static_cast<const float*>(dout);
    small_gemm(false, false, rn, cn, p.d, p.scale, qf, h.ldq, sm.kt, cn, 0.0f, pr, cn, nullptr);
    small_gemm(false, false, rn, cn, p.d, 1.0f, df, h.lddout, sm.vt, cn, 0.0f, dp, cn, nullptr);
  } else {
    product(false, true, rn, cn, p.d, p.scale, q, t, h.ldq, row(h.k, t, h.ldk, c0), t, h.ldk, 0.0f,
            pr, cn);
    product(false, true, rn, cn, p.d, 1.0f, dout, t, h.lddout, row(h.v, t, h.ldv, c0), t, h.ldv,
            0.0f, dp, cn);
  }
  for (int64_t i = 0; i < rn; ++i) {
    float* pi = pr + i * cn;
    const int64_t visible = std::clamp<int64_t>(keys_seen(p, r0 + i) - c0, 0, cn);
    exp_shifted(pi, visible, h.lse[r0 + i]);
    std::fill(pi + visible, pi + cn, 0.0f);
  }
  // dv_blk += p^T dout_blk   (cn, d)
  if (dv_acc != nullptr) {
    if (sm.on())
      small_gemm(true, false, cn, p.d, rn, 1.0f, pr, cn, static_cast<const float*>(dout), h.lddout,
                 1.0f, dv_acc, p.d, nullptr);
    else
      product(true, false, cn, p.d, rn, 1.0f, pr, DType::kF32, cn, dout, t, h.lddout, 1.0f, dv_acc,
              p.d);
  }
  for (int64_t i = 0; i < rn; ++i) ds_from(pr + i * cn, dp + i * cn, D[r0 + i], pr + i * cn, cn);
}

// acc (M, d) += alpha op(ds) x (rows of x with row stride ldx): dk's and dq's products.
void grad_product(bool t_ds, int64_t M, int64_t d, int64_t K, float alpha, const float* ds,
                  int64_t ld_ds, const void* x, DType t, int64_t ldx, float* acc, const Small& sm) {
  if (sm.on())
    small_gemm(t_ds, false, M, d, K, alpha, ds, ld_ds, static_cast<const float*>(x), ldx, 1.0f, acc,
               d, nullptr);
  else
    product(t_ds, false, M, d, K, alpha, ds, DType::kF32, ld_ds, x, t, ldx, 1.0f, acc, d);
}

// The first query block that sees key c0.
int64_t first_query_block(const FlashParams& p, int64_t c0) {
  if (!p.causal) return 0;
  return std::max<int64_t>(0, c0 - (p.tk - p.tq)) / kBQ * kBQ;
}

// dk, dv of key block [c0, c0 + cn) of one head; with dq_acc (tq, d) fp32, also accumulates the
// block's part of dq there. Work: two tiles, (cn, d) accumulators for dk and dv, then (with the
// small GEMM) the block's k and v transposed.
void key_block(const FlashHeadGrad& h, const FlashParams& p, const float* D, int64_t c0, int64_t cn,
               float* work, float* dq_acc, bool small) {
  const int64_t d = p.d;
  const DType t = p.dtype;
  float* pr = work;
  float* dp = pr + kTile;
  float* dk_acc = dp + kTile;
  float* dv_acc = dk_acc + kBK * d;
  Small sm;
  if (small) {
    float* kt = dv_acc + kBK * d;
    transpose_block(h, c0, cn, d, kt, kt + kBK * d);
    sm = {kt, kt + kBK * d};
  }
  std::fill(dk_acc, dk_acc + 2 * kBK * d, 0.0f);
  for (int64_t r0 = first_query_block(p, c0); r0 < p.tq; r0 += kBQ) {
    const int64_t rn = std::min(kBQ, p.tq - r0);
    block_grads(h, p, D, r0, rn, c0, cn, pr, dp, dv_acc, sm);
    // dk_blk += scale ds^T q_blk   (cn, d)
    grad_product(true, cn, d, rn, p.scale, pr, cn, row(h.q, t, h.ldq, r0), t, h.ldq, dk_acc, sm);
    // dq_blk += scale ds k_blk   (rn, d)
    if (dq_acc != nullptr)
      grad_product(false, rn, d, cn, p.scale, pr, cn, row(h.k, t, h.ldk, c0), t, h.ldk,
                   dq_acc + r0 * d, sm);
  }
  store_rows(dk_acc, d, row(h.dk, t, h.lddk, c0), t, h.lddk, cn, d);
  store_rows(dv_acc, d, row(h.dv, t, h.lddv, c0), t, h.lddv, cn, d);
}

// dq of query block [r0, r0 + rn) of one head, into dq_acc (rn, d): the same products, in the
// same order, as key_block's dq part, so both paths agree bit for bit.
void query_block(const FlashHeadGrad& h, const FlashParams& p, const float* D, int64_t r0,
                 int64_t rn, float* work, float* dq_acc, bool small) {
  float* pr = work;
  float* dp = pr + kTile;
  float* kt = dp + kTile + 2 * kBK * p.d;  // key_block's transposes' place
  std::fill(dq_acc, dq_acc + rn * p.d, 0.0f);
  const int64_t kend = keys_seen(p, r0 + rn - 1);
  for (int64_t c0 = 0; c0 < kend; c0 += kBK) {
    const int64_t cn = std::min(kBK, p.tk - c0);  // whole blocks, as key_block multiplies them
    Small sm;
    if (small) {
      transpose_block(h, c0, cn, p.d, kt, kt + kBK * p.d);
      sm = {kt, kt + kBK * p.d};
    }
    block_grads(h, p, D, r0, rn, c0, cn, pr, dp, nullptr, sm);
    grad_product(false, rn, p.d, cn, p.scale, pr, cn, row(h.k, p.dtype, h.ldk, c0), p.dtype, h.ldk,
                 dq_acc, sm);
  }
  store_rows(dq_acc, p.d, row(h.dq, p.dtype, h.lddq, r0), p.dtype, h.lddq, rn, p.d);
}

}  // namespace

int64_t flash_backward_work_floats(int64_t tq, int64_t d, bool per_head) {
  return 2 * kTile + 4 * kBK * d + (per_head ? tq * d : kBQ * d) + 2 * d;
}

void flash_attention_backward(std::span<const FlashHeadGrad> heads, const FlashParams& p) {
  flash_attention_backward(heads, p, flash_products(p));
}

void flash_attention_backward(std::span<const FlashHeadGrad> heads, const FlashParams& p,
                              BlockProducts products) {
  check(p, "flash_attention_backward");
  if (heads.empty() || p.tk == 0) return;
  const int64_t nh = static_cast<int64_t>(heads.size());
  const int64_t d = p.d, tq = p.tq, tk = p.tk;
  const DType t = p.dtype;
  const int64_t q_blocks = (tq + kBQ - 1) / kBQ;
  const int64_t k_blocks = (tk + kBK - 1) / kBK;
  const int threads_max = std::max(1, omp_get_max_threads());
  // One head per thread when the heads divide evenly or are many; else split heads by blocks.
  const bool per_head = nh % threads_max == 0 || nh >= 4 * threads_max;
  const int threads = threads_for(per_head ? nh : nh * std::max(q_blocks, k_blocks));
  const int64_t per_thread = flash_backward_work_floats(tq, d, per_head);
  const bool small = products == BlockProducts::kSmall && t == DType::kF32;
  ScratchFloats work(per_thread * threads);
  ScratchFloats Ds(nh * tq);  // D = rowsum(dout * o) per head
  if (tq == 0) {              // no queries: no gradient reaches the keys
    for (const FlashHeadGrad& h : heads)
      for (int64_t r = 0; r < tk; ++r) {
        std::memset(row(h.dk, t, h.lddk, r), 0, d * dtype_size(t));
        std::memset(row(h.dv, t, h.lddv, r), 0, d * dtype_size(t));
      }
    return;
  }
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* w = work.data() + omp_get_thread_num() * per_thread;
    float* rows2 = w + per_thread - 2 * d;  // two widened rows for D
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nh * tq; ++r) {
      const FlashHeadGrad& h = heads[r / tq];
      const int64_t i = r % tq;
      const void* dout = row(h.dout, t, h.lddout, i);
      const void* o = row(h.o, t, h.ldo, i);
      if (t == DType::kF32) {
        Ds.data()[r] = dot(static_cast<const float*>(dout), static_cast<const float*>(o), d);
      } else {
        convert_serial(dout, t, rows2, DType::kF32, d);
        convert_serial(o, t, rows2 + d, DType::kF32, d);
        Ds.data()[r] = dot(rows2, rows2 + d, d);
      }
    }
    float* acc = w + 2 * kTile + 4 * kBK * d;  // dq accumulator
    if (per_head) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t head = 0; head < nh; ++head) {
        const FlashHeadGrad& h = heads[head];
        std::fill(acc, acc + tq * d, 0.0f);
        for (int64_t c0 = 0; c0 < tk; c0 += kBK)
          key_block(h, p, Ds.data() + head * tq, c0, std::min(kBK, tk - c0), w, acc, small);
        store_rows(acc, d, h.dq, t, h.lddq, tq, d);
      }
    } else {
      // dk, dv by key block: the query blocks that see key block j.
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < nh * k_blocks; ++item) {
        const int64_t head = item % nh, c0 = item / nh * kBK;
        key_block(heads[head], p, Ds.data() + head * tq, c0, std::min(kBK, tk - c0), w, nullptr,
                  small);
      }
      // dq by query block: the key blocks it sees; the costly causal blocks first.
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < nh * q_blocks; ++it) {
        const int64_t item = nh * q_blocks - 1 - it;
        const int64_t head = item % nh, r0 = item / nh * kBQ;
        query_block(heads[head], p, Ds.data() + head * tq, r0, std::min(kBQ, tq - r0), w, acc,
                    small);
      }
    }
  }
}

namespace {

// Heads of random operands and the forward's o and lse, for the backward's measurement.
struct FlashTrial {
  int64_t T, nh, d;
  float scale;
  std::vector<float> buf;
  std::vector<FlashHeadGrad> heads;

  FlashTrial(int64_t T_, int64_t nh_, int64_t d_, float scale_)
      : T(T_), nh(nh_), d(d_), scale(scale_) {
    const int64_t n = nh * T * d;
    buf.assign(static_cast<size_t>(9 * n + nh * T), 0.0f);
    std::mt19937 rng(31);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < 4 * n; ++i) buf[i] = normal(rng);
    float *q = buf.data(), *k = q + n, *v = k + n, *dout = v + n, *o = dout + n, *dq = o + n,
          *dk = dq + n, *dv = dk + n, *lse = dv + n;
    std::vector<FlashHead> fwd;
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t off = h * T * d;
      fwd.push_back({q + off, k + off, v + off, o + off, lse + h * T, d, d, d, d});
      heads.push_back({q + off, k + off, v + off, o + off, dout + off, lse + h * T, dq + off,
                       dk + off, dv + off, d, d, d, d, d, d, d, d});
    }
    flash_attention_forward(fwd, params());
  }
  FlashParams params() const { return {T, T, d, scale, true}; }
};

}  // namespace

BlockProducts flash_products(const FlashParams& p) {
  if (p.dtype != DType::kF32) return BlockProducts::kLibrary;
  const int64_t T = block_products_bucket(p.tk, 128, 4096);
  const int64_t nh = 2 * std::max(1, omp_get_max_threads());
  return measured_block_products(
      fmt::format("flash products d{} T{} t{}", p.d, T, omp_get_max_threads()),
      fmt::format("backward at T {}, {} heads", T, nh), [&]() -> BlockProductsRun {
        auto trial = std::make_shared<FlashTrial>(T, nh, p.d, p.scale);
        return [trial](BlockProducts products) {
          flash_attention_backward(trial->heads, trial->params(), products);
        };
      });
}

}  // namespace kuai::cpu
