// Optimizer updates (AdamW, SGD with momentum/Nesterov) as one streaming pass over a parameter:
// every array is read once and written once, nothing is allocated, and the arithmetic (a sqrt
// and a divide per element) hides under the memory traffic. OpenMP splits the arrays into
// fixed chunks; the per-chunk loop is a KUAI_CLONE kernel. The update formulas are those of
// PyTorch's single-tensor torch.optim.AdamW / torch.optim.SGD.
#include <cmath>
#include <cstdint>

#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/parallel_chunks.h"

namespace kuai::cpu {
namespace {

// 64K floats per chunk: 256 KiB per array, 1 MiB for AdamW's four arrays (fits L2 while a
// thread works on it); 124M parameters give ~1900 chunks, plenty to balance two threads.
constexpr int64_t kChunk = int64_t{1} << 16;

struct AdamWConsts {
  float decay;  // 1 - lr * weight_decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;  // lr * sqrt(bias_correction2) / bias_correction1
  float eps_hat;    // eps * sqrt(bias_correction2)
  float grad_scale;
};

// p (n), g (n), m (n), v (n): the four arrays of one chunk, updated in place.
KUAI_KERNEL void adamw_chunk_kernel(float* __restrict p, const float* __restrict g,
                                    float* __restrict m, float* __restrict v, int64_t n,
                                    AdamWConsts c) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * c.grad_scale;
    const float mi = c.beta1 * m[i] + c.one_minus_beta1 * gi;
    const float vi = c.beta2 * v[i] + c.one_minus_beta2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * c.decay - c.step_size * (mi / (std::sqrt(vi) + c.eps_hat));
  }
}
KUAI_CLONE(adamw_chunk, adamw_chunk_kernel)

struct SgdConsts {
  float lr, momentum, one_minus_dampening, weight_decay, grad_scale;
};

// Plain SGD (momentum == 0): p -= lr * (g * grad_scale + wd * p).
KUAI_KERNEL void sgd_plain_chunk_kernel(float* __restrict p, const float* __restrict g, int64_t n,
                                        SgdConsts c) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * c.grad_scale + c.weight_decay * p[i];
    p[i] = p[i] - c.lr * d;
  }
}
KUAI_CLONE(sgd_plain_chunk, sgd_plain_chunk_kernel)

// SGD with a momentum buffer; first_step initialises buf = d as PyTorch does.
KUAI_KERNEL void sgd_momentum_chunk_kernel(float* __restrict p, const float* __restrict g,
                                           float* __restrict buf, int64_t n, SgdConsts c,
                                           bool nesterov, bool first_step) {
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * c.grad_scale + c.weight_decay * p[i];
    const float b = first_step ? d : c.momentum * buf[i] + c.one_minus_dampening * d;
    buf[i] = b;
    const float step = nesterov ? d + c.momentum * b : b;
    p[i] = p[i] - c.lr * step;
  }
}
KUAI_CLONE(sgd_momentum_chunk, sgd_momentum_chunk_kernel)

}  // namespace

// p, g, m, v (n). PyTorch AdamW: p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps). Multiplying the fraction through by sqrt(bc2)
// gives p -= (lr sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2)): the same value up to a few
// ulp with one divide per element instead of two, which keeps the step at memory speed.
void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamWParams& hp) {
  const float sqrt_bc2 = std::sqrt(hp.bias_correction2);
  const AdamWConsts c{1.0f - hp.lr * hp.weight_decay,
                      hp.beta1,
                      1.0f - hp.beta1,
                      hp.beta2,
                      1.0f - hp.beta2,
                      hp.lr * sqrt_bc2 / hp.bias_correction1,
                      hp.eps * sqrt_bc2,
                      hp.grad_scale};
  parallel_chunks(n, kChunk,
                  [&](int64_t i, int64_t e) { adamw_chunk(p + i, g + i, m + i, v + i, e - i, c); });
}

// p, g, buf (n). buf is not touched (and may be null) when momentum == 0, as in PyTorch.
void sgd_step(float* p, const float* g, float* buf, int64_t n, float lr, float momentum,
              float dampening, float weight_decay, bool nesterov, bool first_step,
              float grad_scale) {
  const SgdConsts c{lr, momentum, 1.0f - dampening, weight_decay, grad_scale};
  if (momentum == 0.0f) {
    parallel_chunks(n, kChunk,
                    [&](int64_t i, int64_t e) { sgd_plain_chunk(p + i, g + i, e - i, c); });
    return;
  }
  parallel_chunks(n, kChunk, [&](int64_t i, int64_t e) {
    sgd_momentum_chunk(p + i, g + i, buf + i, e - i, c, nesterov, first_step);
  });
}

}  // namespace kuai::cpu
