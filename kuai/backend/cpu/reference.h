// Naive references for the CPU kernels in kernels.h: plain loops, double accumulation, no
// threads, no vectorisation. They are the oracles the kernel tests compare against and must stay
// obviously correct rather than fast.
#pragma once

#include <cstdint>

#include "kuai/backend/cpu/kernels.h"

namespace kuai::cpu::ref {

void gelu_forward(const float* x, float* y, int64_t n);
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n);
void sum_axis(const float* x, float* y, int64_t outer, int64_t n, int64_t inner);
void softmax_forward(const float* x, float* y, int64_t rows, int64_t cols, float scale,
                     bool causal);
void softmax_backward(const float* y, const float* dy, float* dx, int64_t rows, int64_t cols,
                      float scale);
void layer_norm_forward(const float* x, const float* w, const float* b, float* y, float* mean,
                        float* rstd, int64_t N, int64_t C, float eps);
void layer_norm_backward(const float* dy, const float* x, const float* w, const float* mean,
                         const float* rstd, float* dx, float* dw, float* db, int64_t N, int64_t C);
void embedding_forward(const float* W, const int32_t* idx, float* out, int64_t N, int64_t C);
void embedding_backward(const float* dout, const int32_t* idx, float* dW, int64_t N, int64_t C,
                        int64_t V);
double cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, int64_t N,
                             int64_t V, int32_t ignore_index, int64_t* count);
void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse,
                            float* dlogits, int64_t N, int64_t V, int32_t ignore_index,
                            float grad_scale);
void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& hp);
void sgd_step(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
              float dampening, float weight_decay, bool nesterov, bool first_step,
              float grad_scale);

void unscale_and_check(float* g, int64_t n, float inv_scale, float* found_inf);

// gelu_backward then sum_axis over the n rows of (n, inner) (reference_reduce.cpp).
void gelu_backward_sum(const float* x, const float* dy, float* dx, float* db, int64_t n,
                       int64_t inner);
// x = a + b, then layer_norm_forward of x (reference_layer_norm.cpp; b fp32 here).
void add_layer_norm_forward(const float* a, const float* b, float* x, const float* w,
                            const float* bias, float* y, float* mean, float* rstd, int64_t N,
                            int64_t C, float eps);
// RMSNorm (reference_rms_norm.cpp): y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps); the backward
// writes dx and dw.
void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t C,
                      float eps);
void rms_norm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                       float* dx, float* dw, int64_t N, int64_t C);
// SiLU and SwiGLU on fp32 (reference_gated.cpp): y = x sigmoid(x); y = silu(gate) up over
// h = [gate | up] (rows, 2F); the backwards as kernels.h states them.
void silu_forward(const float* x, float* y, int64_t n);
void silu_backward(const float* x, const float* dy, float* dx, int64_t n);
void swiglu_forward(const float* h, float* y, int64_t rows, int64_t F);
void swiglu_backward(const float* h, const float* dy, float* dh, int64_t rows, int64_t F);
// Rotary embedding of contiguous fp32 (B, T, heads, d) (reference_rope.cpp): the angle of pair i
// at position p is Hugging Face's fp32 one, fl(fl(p) * fl(1 / fl(theta^(2i/d)))); cos, sin and
// the rotation in double. Heads from rotated_heads on are copied; inverse rotates by -angle.
void rope(const float* x, float* y, int64_t B, int64_t T, int64_t heads, int64_t d,
          int64_t rotated_heads, int64_t pos0, double theta, bool inverse);

}  // namespace kuai::cpu::ref
