// Raw-pointer fp32 kernels of the CPU backend, one family per source file (elementwise.cpp,
// reduce.cpp, softmax.cpp, layer_norm.cpp, embedding.cpp, cross_entropy.cpp, optim.cpp).
// OpenMP-parallel; hot loops are compiled for AVX-512, AVX2+FMA and a portable baseline and the
// best one the running CPU supports is picked at load time (isa.h). Every kernel with math in it
// has a naive counterpart in reference.h that the tests compare against at odd shapes (norms,
// softmax, GELU, SiLU, SwiGLU, RoPE, the fused add + LayerNorm and GELU backward + sum, embedding,
// cross-entropy, the optimizers); the one-line arithmetic (add .. fill, the row broadcasts) is
// checked against a loop in its test, and the _serial, low-precision and fused-accumulate
// variants against their fp32 or unfused versions, bit for bit where they claim it. All tensors
// contiguous, row-major.
#pragma once

#include <cstdint>

#include "kuai/core/dtype.h"

namespace kuai::cpu {

// ---- elementwise (n elements) ----
void add(const float* a, const float* b, float* y, int64_t n);
void sub(const float* a, const float* b, float* y, int64_t n);
void mul(const float* a, const float* b, float* y, int64_t n);
void div(const float* a, const float* b, float* y, int64_t n);
void scale(const float* x, float s, float* y, int64_t n);     // y = s * x
void axpy(float alpha, const float* x, float* y, int64_t n);  // y += alpha * x
void fill(float* y, float value, int64_t n);
// Row broadcast: y(rows, cols) = x(rows, cols) OP b(cols).
void add_row(const float* x, const float* b, float* y, int64_t rows, int64_t cols);
void mul_row(const float* x, const float* b, float* y, int64_t rows, int64_t cols);
// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(const float* x, float* y, int64_t n);
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n);  // dx = dy * gelu'(x)
void gelu_backward_serial(const float* x, const float* dy, float* dx, int64_t n);  // this thread
// The same on bf16 or f16 storage (t; mixed precision): fp32 math in registers, each output
// rounded once to nearest even. Equal to widening, the fp32 kernel and rounding, bit for bit.
void gelu_forward_lowp(const uint16_t* x, uint16_t* y, int64_t n, DType t);
void gelu_backward_lowp(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n, DType t);
// y = a + widen(b): the fp32 residual stream plus a bf16 / f16 branch (exact fp32 sum).
void add_f32_lowp(const float* a, const uint16_t* b, float* y, int64_t n, DType t);

// ---- gated activations (gated.cpp), storage of dtype t (f32, bf16, f16), fp32 math ----
void silu_forward(const void* x, void* y, int64_t n, DType t);  // y = x sigmoid(x)
void silu_backward(const void* x, const void* dy, void* dx, int64_t n, DType t);
// h (rows, 2F): gate columns [0, F), up columns [F, 2F). y (rows, F) = silu(gate) * up.
void swiglu_forward(const void* h, void* y, int64_t rows, int64_t F, DType t);
// dh (rows, 2F): d gate = dy up silu'(gate), d up = dy silu(gate). dh may alias h.
void swiglu_backward(const void* h, const void* dy, void* dh, int64_t rows, int64_t F, DType t);

// ---- rotary position embedding (rope.cpp), Hugging Face's rotate-half layout ----
struct RopeArgs {
  const void* x;  // (B, T, heads, d) with these element strides and a unit last one
  int64_t stride_b, stride_t, stride_h;
  void* y;  // (B, T, heads, d) contiguous; may be x itself when x is contiguous
  int64_t B, T, heads, d;
  int64_t rotated_heads;  // heads [0, rotated_heads) are rotated, the rest copied
  int64_t pos0;           // position of row t = 0
  double theta;           // base of the frequencies theta^(-2i/d)
  bool inverse;           // rotate by -angle (the backward)
  DType dtype;
};
void rope(const RopeArgs& args);

// ---- reductions ----
// x viewed as (outer, n, inner): y(outer, inner) = sum over the middle axis. Fixed summation
// order (deterministic whatever the thread count).
void sum_axis(const float* x, float* y, int64_t outer, int64_t n, int64_t inner);
// dx (n, inner) = gelu_backward(x, dy) and db (inner) = sum_axis(dx, 1, n, inner), each block of
// dx summed while it is in cache: bit for bit the two calls. dx may alias dy.
void gelu_backward_sum(const float* x, const float* dy, float* dx, float* db, int64_t n,
                       int64_t inner);
double sum_squares(const float* x, int64_t n);  // deterministic

// ---- softmax over the last axis of (rows, cols) ----
// y = softmax(scale * x). With causal, row r is query (r % cols) of a (cols x cols) score
// matrix: columns j > r % cols are masked (y = 0 there).
void softmax_forward(const float* x, float* y, int64_t rows, int64_t cols, float scale,
                     bool causal);
// dx = scale * y * (dy - sum(y * dy)) per row.
void softmax_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols,
                      float scale);
// The backward on the calling thread, over the first `len` entries of each row, rows `ld` apart;
// the rest of each row is neither read nor written.
void softmax_backward_serial(const float* y, const float* dy, float* dx, int64_t rows, int64_t len,
                             int64_t ld, float scale);

// ---- LayerNorm over the last axis of x (N, C) ----
// x = a + b, then layer_norm_forward of x, a block of rows at a time (while the block is in
// cache); bit for bit the two calls. b is fp32, bf16 or f16 (an autocast branch, widened: the
// fp32 sum a mixed add gives).
void add_layer_norm_forward(const float* a, const void* b, DType b_dtype, float* x, const float* w,
                            const float* bias, float* y, float* mean, float* rstd, int64_t N,
                            int64_t C, float eps);
void layer_norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                        float* rstd, int64_t N, int64_t C, float eps);
// Writes dx (N, C), dw (C) and db (C) (overwrites, does not accumulate).
void layer_norm_backward(const float* dy, const float* x, const float* w, const float* mean,
                         const float* rstd, float* dx, float* dw, float* db, int64_t N, int64_t C);
// layer_norm_backward whose dx is added into acc (N, C) instead of being stored: bit for bit
// layer_norm_backward then acc += dx (a compiled graph's fusion of the residual gradient).
void layer_norm_backward_add(const float* dy, const float* x, const float* w, const float* mean,
                             const float* rstd, float* acc, float* dw, float* db, int64_t N,
                             int64_t C);

// ---- RMSNorm over the last axis of x (N, C): y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps) ----
void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t C,
                      float eps);
// Writes dx (N, C) and dw (C); dw is reduced over a row partition that depends on N only.
void rms_norm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                       float* dx, float* dw, int64_t N, int64_t C);

// ---- embedding: out(N, C) = W[idx[i]] ----
void embedding_forward(const float* W, const int32_t* idx, float* out, int64_t N, int64_t C);
// dW (V, C) = scatter-add of dout rows at idx (overwrites dW). Deterministic.
void embedding_backward(const float* dout, const int32_t* idx, float* dW, int64_t N, int64_t C,
                        int64_t V);

// ---- fused softmax + cross-entropy over logits (N, V) ----
// Writes lse[i] = logsumexp(logits[i]); returns the sum of -log p[target] over rows whose target
// != ignore_index and stores their number in *count.
double cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, int64_t N,
                             int64_t V, int32_t ignore_index, int64_t* count);
// dlogits[i] = (softmax(logits[i]) - onehot(target[i])) * grad_scale; zero rows where ignored.
// dlogits may alias logits (the engine reuses the logits buffer when nothing else holds it).
void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse,
                            float* dlogits, int64_t N, int64_t V, int32_t ignore_index,
                            float grad_scale);
// The backward's grad_scale: the loss gradient over the number of counted rows (0 when none).
inline float cross_entropy_grad_scale(float dloss, float count) {
  return count > 0 ? dloss / count : 0.0f;
}
// Both in one pass over each block of rows while it is in cache (grad_scale known beforehand):
// returns the forward's loss sum and writes lse and dlogits bit for bit as the two calls do.
// dlogits may alias logits.
double cross_entropy_forward_backward(const float* logits, const int32_t* targets, float* lse,
                                      float* dlogits, int64_t N, int64_t V, int32_t ignore_index,
                                      float grad_scale);

// ---- optimizers: one pass over a parameter's elements ----
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  float bias_correction1;  // 1 - beta1^t
  float bias_correction2;  // 1 - beta2^t
  float grad_scale;        // gradients are multiplied by this first (clipping / unscaling)
};
// p -= lr * (mhat / (sqrt(vhat) + eps) + weight_decay * p), PyTorch AdamW semantics.
void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& hp);
// PyTorch SGD semantics: g' = g*grad_scale + wd*p; buf = momentum*buf + (1-dampening)*g'
// (buf = g' on the first step); p -= lr * (nesterov ? g' + momentum*buf : buf).
void sgd_step(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
              float dampening, float weight_decay, bool nesterov, bool first_step,
              float grad_scale);

// ---- mixed precision ----
// Loss-scale unscaling fused with the overflow check (amp.cpp): g (n) *= inv_scale in place, and
// *found_inf = 1 if any element of g, before or after the multiply, is inf or NaN. found_inf is
// left untouched otherwise, so one flag accumulates over every gradient of a step.
void unscale_and_check(float* g, int64_t n, float inv_scale, float* found_inf);

}  // namespace kuai::cpu
