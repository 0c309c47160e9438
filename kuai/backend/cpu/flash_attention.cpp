// The CPU flash-attention kernels (see flash_attention.h). Forward: per query block, the scores
// of each key block come from one small GEMM, the online-softmax update rescales the running sums
// and the accumulator, and the block's probabilities are multiplied into the accumulator by a
// second GEMM. Backward: the probabilities of a block pair are recomputed from lse, in one pass
// over key blocks (dk, dv) and one over query blocks (dq). The row loops are KUAI_CLONES
// functions, so exp, max and the dot products vectorise.
#include "kuai/backend/cpu/flash_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kuai/backend/cpu/gemm.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/vec_math.h"
#include "kuai/core/allocator.h"

namespace kuai::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

KUAI_CLONES float row_max(const float* s, int64_t n) {
  float m = kNegInf;
  for (int64_t j = 0; j < n; ++j) m = vm::select(s[j] > m, s[j], m);
  return m;
}

// p[j] = exp(s[j] - m) in place; returns their sum.
KUAI_CLONES float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = vm::exp(s[j] - m);
    s[j] = p;
    sum += p;
  }
  return sum;
}

KUAI_CLONES void scale_row(float* x, int64_t n, float a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

}  // namespace

int64_t flash_forward_work_floats(int64_t d) {
  return kFlashBlockQ * kFlashBlockK + kFlashBlockQ * d + 2 * kFlashBlockQ;
}

void flash_attention_forward_rows(const FlashHead& h, int64_t r0, int64_t rn, int64_t T, int64_t d,
                                  float scale, bool causal, float* work) {
  float* s = work;                               // (rn, cn) scores, then probabilities
  float* acc = s + kFlashBlockQ * kFlashBlockK;  // (rn, d) unnormalised output
  float* m = acc + kFlashBlockQ * d;             // running row maximum of the scaled scores
  float* l = m + kFlashBlockQ;                   // running row sum of exp(score - m)
  std::fill(acc, acc + rn * d, 0.0f);
  std::fill(m, m + rn, kNegInf);
  std::fill(l, l + rn, 0.0f);
  const int64_t kend = causal ? r0 + rn : T;  // keys any row of the block can see
  for (int64_t c0 = 0; c0 < kend; c0 += kFlashBlockK) {
    const int64_t cn = std::min(kFlashBlockK, kend - c0);
    // s = scale q_blk k_blk^T   (rn, cn)
    gemm(false, true, rn, cn, d, scale, h.q + r0 * h.ldq, h.ldq, h.k + c0 * h.ldk, h.ldk, 0.0f, s,
         cn);
    for (int64_t i = 0; i < rn; ++i) {
      float* si = s + i * cn;
      // Keys this row sees in the block: all, or up to the diagonal.
      const int64_t visible = causal ? std::clamp<int64_t>(r0 + i - c0 + 1, 0, cn) : cn;
      std::fill(si + visible, si + cn, 0.0f);  // masked: probability 0
      if (visible == 0) continue;
      const float m_new = std::max(m[i], row_max(si, visible));
      const float alpha = std::exp(m[i] - m_new);  // 0 on the first block (m = -inf)
      l[i] = l[i] * alpha + exp_shifted(si, visible, m_new);
      if (alpha != 1.0f) scale_row(acc + i * d, d, alpha);
      m[i] = m_new;
    }
    // acc += p v_blk   (rn, d)
    gemm(false, false, rn, d, cn, 1.0f, s, cn, h.v + c0 * h.ldv, h.ldv, 1.0f, acc, d);
  }
  for (int64_t i = 0; i < rn; ++i) {
    const float inv = 1.0f / l[i];
    float* oi = h.o + (r0 + i) * h.ldo;
    for (int64_t j = 0; j < d; ++j) oi[j] = acc[i * d + j] * inv;
    h.lse[r0 + i] = m[i] + std::log(l[i]);
  }
}

void flash_attention_forward(std::span<const FlashHead> heads, int64_t T, int64_t d, float scale,
                             bool causal) {
  if (heads.empty() || T <= 0) return;
  const int64_t blocks = (T + kFlashBlockQ - 1) / kFlashBlockQ;
  const int64_t items = static_cast<int64_t>(heads.size()) * blocks;
  const int threads = std::max(1, std::min<int>(omp_get_max_threads(), static_cast<int>(items)));
  const int64_t per_thread = flash_forward_work_floats(d);
  ScratchFloats work(per_thread * threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t it = 0; it < items; ++it) {
    // Last query blocks first: with a causal mask they cost the most.
    const int64_t item = items - 1 - it;
    const int64_t nh = static_cast<int64_t>(heads.size());
    const int64_t head = item % nh, blk = item / nh;
    const int64_t r0 = blk * kFlashBlockQ;
    flash_attention_forward_rows(heads[head], r0, std::min(kFlashBlockQ, T - r0), T, d, scale,
                                 causal, work.data() + omp_get_thread_num() * per_thread);
  }
}

namespace {

// For query rows [r0, r0 + rn) and keys [c0, c0 + cn) of one head: p = the probabilities
// recomputed from lse (0 where masked) and dp = dout v^T, both (rn, cn) with row stride cn.
void block_ds(const FlashHeadGrad& h, int64_t r0, int64_t rn, int64_t c0, int64_t cn, int64_t d,
              float scale, bool causal, float* p, float* dp) {
  gemm(false, true, rn, cn, d, scale, h.q + r0 * h.ldq, h.ldq, h.k + c0 * h.ldk, h.ldk, 0.0f, p,
       cn);
  gemm(false, true, rn, cn, d, 1.0f, h.dout + r0 * h.lddout, h.lddout, h.v + c0 * h.ldv, h.ldv,
       0.0f, dp, cn);
  for (int64_t i = 0; i < rn; ++i) {
    float* pi = p + i * cn;
    const int64_t visible = causal ? std::clamp<int64_t>(r0 + i - c0 + 1, 0, cn) : cn;
    exp_shifted(pi, visible, h.lse[r0 + i]);
    std::fill(pi + visible, pi + cn, 0.0f);
  }
}

KUAI_CLONES void ds_from(const float* p, const float* dp, float D, float* ds, int64_t n) {
  for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (dp[j] - D);
}

KUAI_CLONES float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

}  // namespace

void flash_attention_backward(std::span<const FlashHeadGrad> heads, int64_t T, int64_t d,
                              float scale, bool causal) {
  if (heads.empty() || T <= 0) return;
  const int64_t nh = static_cast<int64_t>(heads.size());
  const int64_t blocks = (T + kFlashBlockQ - 1) / kFlashBlockQ;
  static_assert(kFlashBlockQ == kFlashBlockK, "query and key blocks share one index");
  const int64_t items = nh * blocks;
  const int threads = std::max(1, std::min<int>(omp_get_max_threads(), static_cast<int>(items)));
  const int64_t tile = kFlashBlockQ * kFlashBlockK;
  ScratchFloats work(2 * tile * threads);
  ScratchFloats Ds(nh * T);  // D = rowsum(dout * o) per head
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* p = work.data() + omp_get_thread_num() * 2 * tile;
    float* dp = p + tile;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < nh * T; ++r) {
      const FlashHeadGrad& h = heads[r / T];
      const int64_t i = r % T;
      Ds.data()[r] = dot(h.dout + i * h.lddout, h.o + i * h.ldo, d);
    }
    // dk, dv by key block: the query blocks that see key block j are j.. (causal) or all.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t head = item % nh, jb = item / nh;
      const FlashHeadGrad& h = heads[head];
      const float* D = Ds.data() + head * T;
      const int64_t c0 = jb * kFlashBlockK, cn = std::min(kFlashBlockK, T - c0);
      for (int64_t r = c0; r < c0 + cn; ++r) {
        std::fill(h.dk + r * h.lddk, h.dk + r * h.lddk + d, 0.0f);
        std::fill(h.dv + r * h.lddv, h.dv + r * h.lddv + d, 0.0f);
      }
      for (int64_t r0 = causal ? c0 : 0; r0 < T; r0 += kFlashBlockQ) {
        const int64_t rn = std::min(kFlashBlockQ, T - r0);
        block_ds(h, r0, rn, c0, cn, d, scale, causal, p, dp);
        // dv_blk += p^T dout_blk   (cn, d)
        gemm(true, false, cn, d, rn, 1.0f, p, cn, h.dout + r0 * h.lddout, h.lddout, 1.0f,
             h.dv + c0 * h.lddv, h.lddv);
        for (int64_t i = 0; i < rn; ++i)
          ds_from(p + i * cn, dp + i * cn, D[r0 + i], p + i * cn, cn);
        // dk_blk += scale ds^T q_blk   (cn, d)
        gemm(true, false, cn, d, rn, scale, p, cn, h.q + r0 * h.ldq, h.ldq, 1.0f,
             h.dk + c0 * h.lddk, h.lddk);
      }
    }
    // dq by query block: the key blocks it sees are 0..i (causal) or all.
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t item = items - 1 - it;  // costly causal blocks first
      const int64_t head = item % nh, ib = item / nh;
      const FlashHeadGrad& h = heads[head];
      const float* D = Ds.data() + head * T;
      const int64_t r0 = ib * kFlashBlockQ, rn = std::min(kFlashBlockQ, T - r0);
      const int64_t kend = causal ? r0 + rn : T;
      for (int64_t c0 = 0; c0 < kend; c0 += kFlashBlockK) {
        const int64_t cn = std::min(kFlashBlockK, kend - c0);
        block_ds(h, r0, rn, c0, cn, d, scale, causal, p, dp);
        for (int64_t i = 0; i < rn; ++i)
          ds_from(p + i * cn, dp + i * cn, D[r0 + i], p + i * cn, cn);
        // dq_blk (+)= scale ds k_blk   (rn, d)
        gemm(false, false, rn, d, cn, scale, p, cn, h.k + c0 * h.ldk, h.ldk, c0 == 0 ? 0.0f : 1.0f,
             h.dq + r0 * h.lddq, h.lddq);
      }
    }
  }
}

}  // namespace kuai::cpu
