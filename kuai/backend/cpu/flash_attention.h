// FlashAttention (Dao et al., 2022; the backward as in FlashAttention-2) for the CPU: exact
// attention computed one block of queries against one block of keys at a time with an online
// softmax (a running row maximum and row sum), so the T x T score matrix is never materialised.
// Each thread holds a (128, 256) score tile and a (128, d) fp32 accumulator (L2-sized); the forward
// writes the output and every row's log-sum-exp, from which the backward recomputes the
// probabilities. With a causal mask the key blocks above the diagonal are skipped. Block sizes
// were chosen by bench/bench_attention.cpp (64 to 512 rows and keys tried).
//
// Operands are stored as f32, bf16 or f16 (one dtype for all of them) with any row stride; every
// product reads them where they lie (the packed GEMM widens bf16/f16 while packing, gemm_packed.h)
// and accumulates in fp32; the outputs are rounded once. Scores, probabilities and lse are fp32.
//
// Queries may be fewer than keys (a KV cache: new query rows against cached keys): query row i
// then sits at position tk - tq + i, and with a causal mask sees the keys up to that position.
#pragma once

#include <cstdint>
#include <span>

#include "kuai/backend/cpu/block_products.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {

inline constexpr int64_t kFlashBlockQ = 128;  // query rows per block of the forward
inline constexpr int64_t kFlashBlockK = 256;  // keys per block of the forward
// The backward's blocks: its five products per block pair are ordered by them, and its (256, 128)
// probability and gradient tiles of a pair stay in L2.
inline constexpr int64_t kFlashBlockQBackward = 128;
inline constexpr int64_t kFlashBlockKBackward = 128;

struct FlashParams {
  int64_t tq = 0;  // query rows
  int64_t tk = 0;  // keys; with causal, tk >= tq
  int64_t d = 0;   // head_dim
  float scale = 1.0f;
  bool causal = true;
  DType dtype = DType::kF32;  // of q, k, v, o (and dout, dq, dk, dv)
};

// One (batch, head): q (tq, d), k, v (tk, d), the output o (tq, d), each with its own row stride;
// lse (tq), the natural log of each row's softmax denominator of the scaled scores.
struct FlashHead {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  int64_t ldq, ldk, ldv, ldo;
};

// Floats of per-thread work space flash_attention_forward_rows needs for head_dim d.
int64_t flash_forward_work_floats(int64_t d);

// Query rows [r0, r0 + rn) (rn <= kFlashBlockQ) of one head: o = softmax(scale q k^T) v with the
// keys after each query's position masked when causal, and lse. `work` holds
// flash_forward_work_floats(d). Runs on the calling thread (its GEMMs too when called inside a
// parallel region).
void flash_attention_forward_rows(const FlashHead& h, int64_t r0, int64_t rn, const FlashParams& p,
                                  float* work);

// All heads, in parallel over (head, query block), the causal blocks (whose cost grows with their
// position) handed out dynamically, costly first, so threads finish together. The work space comes
// from the tracking allocator (threads x flash_forward_work_floats(d): O(d), not O(T^2)).
void flash_attention_forward(std::span<const FlashHead> heads, const FlashParams& p);

// Backward of one head: from q, k, v, the forward's o and lse, and the output gradient dout,
// dq (tq, d), dk, dv (tk, d) with their own row strides (written, not accumulated into).
struct FlashHeadGrad {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse;
  void* dq;
  void* dk;
  void* dv;
  int64_t ldq, ldk, ldv, ldo, lddout, lddq, lddk, lddv;
};

// All heads. D = rowsum(dout * o) stands in for rowsum(dP * P); the probabilities of a block
// pair are recomputed from lse. With at least as many heads as threads, each head runs on one
// thread in a single pass over key blocks (five products per block pair; dq accumulates in an
// fp32 (tq, d) buffer of the thread). With fewer heads, two race-free passes share the work of a
// head between threads: dk and dv by key block, then dq by query block (seven products per pair,
// the scores recomputed twice). Both paths do the same products in the same order, so the results
// are identical bit for bit whatever the thread count. Work space: O(tq d) per thread and O(tq)
// per head, from the tracking allocator.
void flash_attention_backward(std::span<const FlashHeadGrad> heads, const FlashParams& p);

// The backward with its fp32 products on `products` (block_products.h; kAuto: flash_products(p)).
// The small GEMM reads each key block's k and v transposed, made once per key block.
void flash_attention_backward(std::span<const FlashHeadGrad> heads, const FlashParams& p,
                              BlockProducts products);

// kAuto resolved for the backward at p: kLibrary or kSmall, measured the first time a head_dim and
// T bucket (the power of two at or above tk, 128 to 4096) is asked for (block_products.h: the
// backward of both at the bucket's T with two heads per thread; entry "flash products d64 T1024
// t2"). Low-precision heads: kLibrary. The forward's products stay on the
// libraries: the small GEMM measured no faster there (its scores would need k transposed per
// query block).
BlockProducts flash_products(const FlashParams& p);

// Floats of per-thread work space the backward takes (one head per thread or split heads).
int64_t flash_backward_work_floats(int64_t tq, int64_t d, bool per_head);

}  // namespace kuai::cpu
