// CPU evaluation of the naive attention primitives: heads in parallel, each head's products on
// one thread (see backend/cpu/attention.h).
#include <vector>

#include "kuai/backend/cpu/attention.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"

namespace kuai {
namespace {

// Kernels need a unit last stride; anything else is copied once.
Tensor unit_last_stride(const Tensor& t) {
  return t.strides().back() == 1 || t.shape().back() == 1 ? t : contiguous(t.detach());
}

// Head h of batch b of (B, H, T, d) views q, k, v.
cpu::HeadView head_view(const Tensor& q, const Tensor& k, const Tensor& v, int64_t b, int64_t h) {
  auto at = [&](const Tensor& t) {
    return t.data<float>() + b * t.strides()[0] + h * t.strides()[1];
  };
  return {at(q), at(k), at(v), q.strides()[2], k.strides()[2], v.strides()[2]};
}

std::vector<float>& scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf;
}

}  // namespace

void Attention::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  float* y = out[0].data<float>();  // (B, T, H, d)
  float* p = out[1].data<float>();  // (B, H, T, T)
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const cpu::HeadView hv = head_view(q, k, v, b, h);
    cpu::attention_head_forward(hv, p + bh * T * T, y + (b * T * H + h) * d, H * d, T, d, scale_,
                                causal_, scratch(T * T).data());
  }
}

void AttentionBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const Tensor& p = in[3];                    // (B, H, T, T) contiguous
  const Tensor dy = unit_last_stride(in[4]);  // (B, T, H, d)
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  const float *pp = p.data<float>(), *pdy = dy.data<float>();
  float* dq = out[0].data<float>();  // (B, T, 3, H, d): dq, dk, dv side by side
  float* dk = dq + H * d;
  float* dv = dk + H * d;
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const cpu::HeadView hv = head_view(q, k, v, b, h);
    const int64_t o = (b * T * 3 * H + h) * d;  // head h of batch b in (B, T, 3, H, d)
    cpu::attention_head_backward(hv, pp + bh * T * T,
                                 pdy + b * dy.strides()[0] + h * dy.strides()[2], dy.strides()[1],
                                 dq + o, 3 * H * d, dk + o, 3 * H * d, dv + o, 3 * H * d, T, d,
                                 scale_, causal_, scratch(T * T).data());
  }
}

}  // namespace kuai
