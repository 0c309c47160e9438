// The CPU flash-attention forward (see flash_attention.h): per query block, the scores of each
// key block come from one small GEMM, the online-softmax update rescales the running sums and
// the accumulator, and the block's probabilities are multiplied into the accumulator by a second
// GEMM. The row loops are KUAI_CLONES functions, so exp and max vectorise.
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

}  // namespace kuai::cpu
