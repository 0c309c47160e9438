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

// ---- bf16 / f16 operands ----
// Each head is widened into per-thread fp32 buffers, computed by the fp32 head kernels and
// rounded once into the outputs: the probabilities are stored (and saved for backward) in the
// low dtype, and nothing of size (B, H, T, T) is ever held in fp32.

struct LowpScratch {
  std::vector<float> q, k, v, p, y, s;
};
LowpScratch& lowp_scratch() {
  thread_local LowpScratch s;
  return s;
}

// Rows [0, T) of a (T, d) matrix with row stride ld, of dtype t, into dense fp32 dst. bf16 rows
// convert inline (a shift; one call per row would cost as much as the row); f16 rows through
// convert_serial (its F16C path is chosen at run time; this file is built for the baseline ISA).
void widen_rows(const void* src, DType t, int64_t ld, float* dst, int64_t T, int64_t d) {
  if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t r = 0; r < T; ++r)
      for (int64_t j = 0; j < d; ++j) dst[r * d + j] = bf16_to_float(s[r * ld + j]);
    return;
  }
  const int64_t es = dtype_size(t);
  for (int64_t r = 0; r < T; ++r)
    convert_serial(static_cast<const char*>(src) + r * ld * es, t, dst + r * d, DType::kF32, d);
}
void narrow_rows(const float* src, void* dst, DType t, int64_t ld, int64_t T, int64_t d) {
  if (t == DType::kBF16) {
    uint16_t* o = static_cast<uint16_t*>(dst);
    for (int64_t r = 0; r < T; ++r)
      for (int64_t j = 0; j < d; ++j) o[r * ld + j] = float_to_bf16(src[r * d + j]);
    return;
  }
  const int64_t es = dtype_size(t);
  for (int64_t r = 0; r < T; ++r)
    convert_serial(src + r * d, DType::kF32, static_cast<char*>(dst) + r * ld * es, t, d);
}

const char* head_ptr(const Tensor& t, int64_t b, int64_t h) {
  return static_cast<const char*>(t.raw_data()) +
         (b * t.strides()[0] + h * t.strides()[1]) * dtype_size(t.dtype());
}

// Widens head (b, h) of q, k, v into s.q, s.k, s.v (dense (T, d)).
cpu::HeadView widen_head(const Tensor& q, const Tensor& k, const Tensor& v, int64_t b, int64_t h,
                         LowpScratch& s) {
  const int64_t T = q.shape()[2], d = q.shape()[3];
  for (auto* buf : {&s.q, &s.k, &s.v})
    if (static_cast<int64_t>(buf->size()) < T * d) buf->resize(T * d);
  widen_rows(head_ptr(q, b, h), q.dtype(), q.strides()[2], s.q.data(), T, d);
  widen_rows(head_ptr(k, b, h), k.dtype(), k.strides()[2], s.k.data(), T, d);
  widen_rows(head_ptr(v, b, h), v.dtype(), v.strides()[2], s.v.data(), T, d);
  return {s.q.data(), s.k.data(), s.v.data(), d, d, d};
}

void forward_lowp(std::span<const Tensor> in, std::span<Tensor> out, float scale, bool causal) {
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  const DType t = q.dtype();
  const int64_t es = dtype_size(t);
  char* y = static_cast<char*>(out[0].raw_data());  // (B, T, H, d)
  char* p = static_cast<char*>(out[1].raw_data());  // (B, H, T, T)
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    LowpScratch& s = lowp_scratch();
    const cpu::HeadView hv = widen_head(q, k, v, b, h, s);
    if (static_cast<int64_t>(s.p.size()) < T * T) s.p.resize(T * T);
    if (static_cast<int64_t>(s.y.size()) < T * d) s.y.resize(T * d);
    cpu::attention_head_forward(hv, s.p.data(), s.y.data(), d, T, d, scale, causal,
                                scratch(T * T).data());
    convert_serial(s.p.data(), DType::kF32, p + bh * T * T * es, t, T * T);
    narrow_rows(s.y.data(), y + (b * T * H + h) * d * es, t, H * d, T, d);
  }
}

void backward_lowp(std::span<const Tensor> in, std::span<Tensor> out, float scale, bool causal) {
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const Tensor& p = in[3];                    // (B, H, T, T) contiguous
  const Tensor dy = unit_last_stride(in[4]);  // (B, T, H, d)
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  const DType t = q.dtype();
  const int64_t es = dtype_size(t);
  char* dqkv = static_cast<char*>(out[0].raw_data());  // (B, T, 3, H, d)
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    LowpScratch& s = lowp_scratch();
    const cpu::HeadView hv = widen_head(q, k, v, b, h, s);
    if (static_cast<int64_t>(s.p.size()) < T * T) s.p.resize(T * T);
    if (static_cast<int64_t>(s.y.size()) < 4 * T * d) s.y.resize(4 * T * d);
    float* dy32 = s.y.data();  // then dq, dk, dv, each dense (T, d)
    float* dq = dy32 + T * d;
    float* dk = dq + T * d;
    float* dv = dk + T * d;
    convert_serial(static_cast<const char*>(p.raw_data()) + bh * T * T * es, t, s.p.data(),
                   DType::kF32, T * T);
    widen_rows(
        static_cast<const char*>(dy.raw_data()) + (b * dy.strides()[0] + h * dy.strides()[2]) * es,
        t, dy.strides()[1], dy32, T, d);
    cpu::attention_head_backward(hv, s.p.data(), dy32, d, dq, d, dk, d, dv, d, T, d, scale, causal,
                                 scratch(T * T).data());
    const int64_t o = (b * T * 3 * H + h) * d;  // head h of batch b in (B, T, 3, H, d)
    narrow_rows(dq, dqkv + o * es, t, 3 * H * d, T, d);
    narrow_rows(dk, dqkv + (o + H * d) * es, t, 3 * H * d, T, d);
    narrow_rows(dv, dqkv + (o + 2 * H * d) * es, t, 3 * H * d, T, d);
  }
}

}  // namespace

void Attention::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  if (in[0].dtype() != DType::kF32) return forward_lowp(in, out, scale_, causal_);
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
  if (in[0].dtype() != DType::kF32) return backward_lowp(in, out, scale_, causal_);
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
