// Naive attention per head with causal block skipping (see attention.h). Every product goes
// through cpu::gemm, called from inside the caller's parallel loop over heads, where it runs on
// one thread.
#include "kuai/backend/cpu/attention.h"

#include <algorithm>
#include <cstring>

#include "kuai/backend/cpu/gemm.h"
#include "kuai/backend/cpu/kernels.h"

namespace kuai::cpu {

void attention_head_forward(const HeadView& h, float* p, float* y, int64_t ldy, int64_t T,
                            int64_t d, float scale, bool causal, float* s) {
  const int64_t B = kAttentionBlock;
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;  // keys this query block can see
    // s[r0:r0+rn, 0:cols] = scale * q_blk k[0:cols]^T   (rn, cols)
    gemm(false, true, rn, cols, d, scale, h.q + r0 * h.ldq, h.ldq, h.k, h.ldk, 0.0f, s + r0 * T, T);
  }
  softmax_forward(s, p, T, T, 1.0f, causal);  // reads only the unmasked entries; zeros the rest
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;
    // y_blk = p[r0:r0+rn, 0:cols] v[0:cols]   (rn, d)
    gemm(false, false, rn, d, cols, 1.0f, p + r0 * T, T, h.v, h.ldv, 0.0f, y + r0 * ldy, ldy);
  }
}

void attention_head_backward(const HeadView& h, const float* p, const float* dy, int64_t lddy,
                             float* dq, int64_t lddq, float* dk, int64_t lddk, float* dv,
                             int64_t lddv, int64_t T, int64_t d, float scale, bool causal,
                             float* dp) {
  const int64_t B = kAttentionBlock;
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;
    // dp_blk = dy_blk v[0:cols]^T   (rn, cols); the masked rest of the rows is zero
    gemm(false, true, rn, cols, d, 1.0f, dy + r0 * lddy, lddy, h.v, h.ldv, 0.0f, dp + r0 * T, T);
    for (int64_t r = r0; r < r0 + rn && cols < T; ++r)
      std::memset(dp + r * T + cols, 0, static_cast<size_t>(T - cols) * sizeof(float));
  }
  // ds = scale * p * (dp - rowsum(p * dp)), in place over dp (masked entries: p = 0, so 0).
  softmax_backward(p, dp, dp, T, T, scale);
  for (int64_t r0 = 0; r0 < T; r0 += B) {
    const int64_t rn = std::min(B, T - r0);
    const int64_t cols = causal ? r0 + rn : T;
    // dq_blk = ds[r0:r0+rn, 0:cols] k[0:cols]   (rn, d)
    gemm(false, false, rn, d, cols, 1.0f, dp + r0 * T, T, h.k, h.ldk, 0.0f, dq + r0 * lddq, lddq);
  }
  for (int64_t c0 = 0; c0 < T; c0 += B) {
    const int64_t cn = std::min(B, T - c0);
    const int64_t first = causal ? c0 : 0;  // queries that see this key block
    const int64_t rows = T - first;
    // dk_blk = ds[first:T, c0:c0+cn]^T q[first:T]   (cn, d)
    gemm(true, false, cn, d, rows, 1.0f, dp + first * T + c0, T, h.q + first * h.ldq, h.ldq, 0.0f,
         dk + c0 * lddk, lddk);
    // dv_blk = p[first:T, c0:c0+cn]^T dy[first:T]   (cn, d)
    gemm(true, false, cn, d, rows, 1.0f, p + first * T + c0, T, dy + first * lddy, lddy, 0.0f,
         dv + c0 * lddv, lddv);
  }
}

}  // namespace kuai::cpu
