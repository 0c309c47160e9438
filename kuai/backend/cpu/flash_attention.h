// FlashAttention (Dao et al., 2022; the backward as in FlashAttention-2) for the CPU: exact
// attention computed one block of queries against one block of keys at a time with an online
// softmax (a running row maximum and row sum), so the T x T score matrix is never materialised.
// Each thread holds (64, 64) tiles and a (64, d) fp32 accumulator; the forward writes the output
// and every row's log-sum-exp, from which the backward recomputes the probabilities. With a
// causal mask the key blocks above the diagonal are skipped. fp32 operands; rows may have any
// stride.
#pragma once

#include <cstdint>
#include <span>

namespace kuai::cpu {

inline constexpr int64_t kFlashBlockQ = 64;  // query rows per block
inline constexpr int64_t kFlashBlockK = 64;  // keys per block

// One (batch, head): q, k, v (T, d) and the output o (T, d), each with its own row stride; lse
// (T), the natural log of each row's softmax denominator of the scaled scores.
struct FlashHead {
  const float* q;
  const float* k;
  const float* v;
  float* o;
  float* lse;
  int64_t ldq, ldk, ldv, ldo;
};

// Floats of per-thread work space flash_attention_forward_rows needs for head_dim d.
int64_t flash_forward_work_floats(int64_t d);

// Query rows [r0, r0 + rn) (rn <= kFlashBlockQ) of one head: o = softmax(scale q k^T) v with
// keys after the query masked when causal, and lse. `work` holds flash_forward_work_floats(d).
// Runs on the calling thread (its GEMMs too when called inside a parallel region).
void flash_attention_forward_rows(const FlashHead& h, int64_t r0, int64_t rn, int64_t T, int64_t d,
                                  float scale, bool causal, float* work);

// All heads, in parallel over (head, query block), the causal blocks (whose cost grows with
// their position) handed out dynamically so threads finish together; the work space comes from
// the tracking allocator (threads x flash_forward_work_floats(d): O(d), not O(T^2)).
void flash_attention_forward(std::span<const FlashHead> heads, int64_t T, int64_t d, float scale,
                             bool causal);

// Backward of one head: from q, k, v, the forward's o and lse, and the output gradient dout,
// dq, dk, dv (T, d) with their own row strides. Scores and probabilities are recomputed a block
// at a time from lse; D = rowsum(dout * o) stands in for rowsum(dP * P).
struct FlashHeadGrad {
  const float* q;
  const float* k;
  const float* v;
  const float* o;
  const float* dout;
  const float* lse;
  float* dq;
  float* dk;
  float* dv;
  int64_t ldq, ldk, ldv, ldo, lddout, lddq, lddk, lddv;
};

// All heads. Two passes, both race-free and independent of the thread count: dk and dv by key
// block (each key block meets every query block that sees it), then dq by query block (each
// query block meets every key block it sees); the scores are recomputed in both. Work space:
// per thread two (64, 64) tiles, and D, O(T) per head, all from the tracking allocator.
void flash_attention_backward(std::span<const FlashHeadGrad> heads, int64_t T, int64_t d,
                              float scale, bool causal);

}  // namespace kuai::cpu
