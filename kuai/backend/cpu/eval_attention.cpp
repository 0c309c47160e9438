// CPU evaluation of the attention primitives. Naive: heads in parallel, each head's products on
// one thread (see backend/cpu/attention.h). Flash: the (batch, head) views handed to the tiled
// kernels of backend/cpu/flash_attention.h, which parallelise over heads and blocks themselves.
#include <omp.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kuai/backend/cpu/attention.h"
#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/flash_attention.h"
#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"

namespace kuai {
namespace {

// Kernels need a unit last stride; anything else is copied once.
Tensor unit_last_stride(const Tensor& t) {
  return t.strides().back() == 1 || t.shape().back() == 1 ? t : contiguous(t.detach());
}

// Query heads per key/value head (grouped-query attention; 1 for multi-head attention).
int64_t group_of(const Tensor& q, const Tensor& k) { return q.size(1) / k.size(1); }

// Head h of batch b of (B, H, T, d) views q and (B, Hkv, T, d) views k, v: key/value head h / G.
cpu::HeadView head_view(const Tensor& q, const Tensor& k, const Tensor& v, int64_t b, int64_t h) {
  const int64_t kh = h / group_of(q, k);
  auto at = [&](const Tensor& t, int64_t head) {
    return t.device_data<float>() + b * t.strides()[0] + head * t.strides()[1];
  };
  return {at(q, h), at(k, kh), at(v, kh), q.strides()[2], k.strides()[2], v.strides()[2]};
}

// Where an attention backward writes the gradients of head h of batch b. The output is (B, T, H +
// 2 Hkv, d): dq in heads [0, H), dk in [H, H + Hkv), dv after. With groups (Hkv < H) every query
// head's dk, dv go to a (B, T, 2, H, d) scratch first and are summed over the group by
// sum_kv_groups; otherwise straight into the output.
struct GradTarget {
  char* g;        // the output (B, T, H + 2 Hkv, d)
  char* scratch;  // (B, T, 2, H, d) when grouped, else null
  int64_t T, H, Hkv, d, es;
  char* dq(int64_t b, int64_t h) const { return g + ((b * T * (H + 2 * Hkv) + h) * d) * es; }
  int64_t ldq() const { return (H + 2 * Hkv) * d; }
  char* dkv(int64_t b, int64_t h, int slot) const {
    if (scratch != nullptr) return scratch + ((b * T * 2 + slot) * H + h) * d * es;
    return g + ((b * T * (H + 2 * Hkv) + H + slot * Hkv + h) * d) * es;
  }
  int64_t ldkv() const { return scratch != nullptr ? 2 * H * d : (H + 2 * Hkv) * d; }
};

// dk, dv of key/value head j = the sum over its G query heads, in head order and in fp32, rounded
// to the output's dtype. In bf16 / f16 each head's part was already rounded when the kernel wrote
// it, as in PyTorch's repeat_kv backward (each repeated head's gradient in the low dtype, then
// summed).
void sum_kv_groups(const GradTarget& t, int64_t B, DType dtype) {
  const int64_t G = t.H / t.Hkv, d = t.d, es = t.es;
#pragma omp parallel
  {
    std::vector<float> acc(static_cast<size_t>(d)), wide(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < B * t.T; ++r)
      for (int slot = 0; slot < 2; ++slot)
        for (int64_t j = 0; j < t.Hkv; ++j) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t gi = 0; gi < G; ++gi) {
            const char* src = t.scratch + ((r * 2 + slot) * t.H + j * G + gi) * d * es;
            convert_serial(src, dtype, wide.data(), DType::kF32, d);
            for (int64_t i = 0; i < d; ++i) acc[i] += wide[i];
          }
          char* dst = t.g + ((r * (t.H + 2 * t.Hkv) + t.H + slot * t.Hkv + j) * d) * es;
          convert_serial(acc.data(), DType::kF32, dst, dtype, d);
        }
  }
}

// The backward's targets for q (B, H, T, d), k (B, Hkv, T, d) into output g; `scratch` holds the
// grouped case's per-head dk, dv for the call.
GradTarget grad_target(const Tensor& q, const Tensor& k, Tensor& g,
                       std::unique_ptr<ScratchBytes>& scratch) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3), Hkv = k.size(1);
  const int64_t es = dtype_size(q.dtype());
  if (Hkv != H)
    scratch = std::make_unique<ScratchBytes>(static_cast<size_t>(B * T * 2 * H * d * es));
  return {static_cast<char*>(g.device_ptr()),
          scratch ? static_cast<char*>(scratch->data()) : nullptr,
          T,
          H,
          Hkv,
          d,
          es};
}

// Per-thread T x T buffers from the tracking allocator (so the naive kernel's scratch shows in the
// peak it is compared by, and is returned after the op): `slots` of them per thread, thread t's
// slot i at at(t, i).
class HeadScratch {
 public:
  // `slots` T x T buffers per thread, then `extra` floats (the fp32 kernels' k^T or v^T, d x T).
  HeadScratch(int64_t T, int64_t heads, int slots, int64_t extra = 0)
      : n_(T * T),
        slots_(slots),
        per_thread_(n_ * slots + extra),
        buf_(per_thread_ * std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), heads))) {}
  float* at(int slot) const { return buf_.data() + omp_get_thread_num() * per_thread_ + slot * n_; }
  float* extra() const { return buf_.data() + omp_get_thread_num() * per_thread_ + slots_ * n_; }

 private:
  int64_t n_;
  int slots_;
  int64_t per_thread_;
  ScratchFloats buf_;
};

// ---- bf16 / f16 operands ----
// Each head runs on its typed operands (attention.h's TypedHeadView): the products read the
// bf16/f16 q, k, v and dy where they lie and write y, dq, dk, dv rounded once. The probabilities
// are computed in a per-thread fp32 buffer and stored (and saved for backward) in the low dtype,
// so nothing of size (B, H, T, T) is ever held in fp32.

const char* head_ptr(const Tensor& t, int64_t b, int64_t h) {
  return static_cast<const char*>(t.device_ptr()) +
         (b * t.strides()[0] + h * t.strides()[1]) * dtype_size(t.dtype());
}

cpu::TypedHeadView typed_head(const Tensor& q, const Tensor& k, const Tensor& v, int64_t b,
                              int64_t h) {
  const int64_t kh = h / group_of(q, k);
  return {head_ptr(q, b, h), head_ptr(k, b, kh), head_ptr(v, b, kh), q.strides()[2],
          k.strides()[2],    v.strides()[2],     q.dtype()};
}

void forward_lowp(std::span<const Tensor> in, std::span<Tensor> out, float scale, bool causal) {
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  const DType t = q.dtype();
  const int64_t es = dtype_size(t);
  char* y = static_cast<char*>(out[0].device_ptr());  // (B, T, H, d)
  char* p = static_cast<char*>(out[1].device_ptr());  // (B, H, T, T)
  const HeadScratch scratch(T, B * H, 2);
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    float* p32 = scratch.at(1);
    cpu::attention_head_forward(typed_head(q, k, v, b, h), p32, y + (b * T * H + h) * d * es, H * d,
                                T, d, scale, causal, scratch.at(0));
    convert_serial(p32, DType::kF32, p + bh * T * T * es, t, T * T);
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
  std::unique_ptr<ScratchBytes> kv_scratch;
  const GradTarget gt = grad_target(q, k, out[0], kv_scratch);
  const HeadScratch scratch(T, B * H, 2);
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    float* p32 = scratch.at(1);
    convert_serial(static_cast<const char*>(p.device_ptr()) + bh * T * T * es, t, p32, DType::kF32,
                   T * T);
    const char* dyh = static_cast<const char*>(dy.device_ptr()) +
                      (b * dy.strides()[0] + h * dy.strides()[2]) * es;
    cpu::attention_head_backward(typed_head(q, k, v, b, h), p32, dyh, dy.strides()[1], gt.dq(b, h),
                                 gt.ldq(), gt.dkv(b, h, 0), gt.ldkv(), gt.dkv(b, h, 1), gt.ldkv(),
                                 T, d, scale, causal, scratch.at(0));
  }
  if (kv_scratch) sum_kv_groups(gt, B, t);
}

}  // namespace

void Attention::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  if (in[0].dtype() != DType::kF32) return forward_lowp(in, out, scale_, causal_);
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  float* y = out[0].device_data<float>();  // (B, T, H, d)
  float* p = out[1].device_data<float>();  // (B, H, T, T)
  const bool small = cpu::naive_attention_products(T, d) == cpu::BlockProducts::kSmall;
  const HeadScratch scratch(T, B * H, 1, d * T);
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const cpu::HeadView hv = head_view(q, k, v, b, h);
    cpu::attention_head_forward(hv, p + bh * T * T, y + (b * T * H + h) * d, H * d, T, d, scale_,
                                causal_, scratch.at(0), small ? scratch.extra() : nullptr);
  }
}

void AttentionBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  if (in[0].dtype() != DType::kF32) return backward_lowp(in, out, scale_, causal_);
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const Tensor& p = in[3];                    // (B, H, T, T) contiguous
  const Tensor dy = unit_last_stride(in[4]);  // (B, T, H, d)
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  const float *pp = p.device_data<float>(), *pdy = dy.device_data<float>();
  std::unique_ptr<ScratchBytes> kv_scratch;
  const GradTarget gt = grad_target(q, k, out[0], kv_scratch);
  auto f = [](char* c) { return reinterpret_cast<float*>(c); };
  const bool small = cpu::naive_attention_products(T, d) == cpu::BlockProducts::kSmall;
  const HeadScratch scratch(T, B * H, 1, d * T);
#pragma omp parallel for schedule(static) if (B * H > 1)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const cpu::HeadView hv = head_view(q, k, v, b, h);
    cpu::attention_head_backward(
        hv, pp + bh * T * T, pdy + b * dy.strides()[0] + h * dy.strides()[2], dy.strides()[1],
        f(gt.dq(b, h)), gt.ldq(), f(gt.dkv(b, h, 0)), gt.ldkv(), f(gt.dkv(b, h, 1)), gt.ldkv(), T,
        d, scale_, causal_, scratch.at(0), small ? scratch.extra() : nullptr);
  }
  if (kv_scratch) sum_kv_groups(gt, B, DType::kF32);
}

namespace {

// Element (b, h) of a 4-D tensor whose dims 0 and 1 are batch and head, or (with `bthd`) of a
// (B, T, H, d) tensor, as a byte pointer.
const char* bh_ptr(const Tensor& t, int64_t b, int64_t h, bool bthd = false) {
  return static_cast<const char*>(t.device_ptr()) +
         (b * t.strides()[0] + h * t.strides()[bthd ? 2 : 1]) * dtype_size(t.dtype());
}
char* bh_ptr(Tensor& t, int64_t b, int64_t h, bool bthd = false) {
  return const_cast<char*>(bh_ptr(static_cast<const Tensor&>(t), b, h, bthd));
}

}  // namespace

void FlashAttention::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]);
  const int64_t B = q.size(0), H = q.size(1), G = group_of(q, k);
  Tensor& y = out[0];                        // (B, tq, H, d)
  float* lse = out[1].device_data<float>();  // (B, H, tq)
  const cpu::FlashParams p{q.size(2), k.size(2), q.size(3), scale_, causal_, q.dtype()};
  std::vector<cpu::FlashHead> heads;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      heads.push_back({bh_ptr(q, b, h), bh_ptr(k, b, h / G), bh_ptr(v, b, h / G),
                       bh_ptr(y, b, h, true), lse + (b * H + h) * p.tq, q.strides()[2],
                       k.strides()[2], v.strides()[2], y.strides()[1]});
  cpu::flash_attention_forward(heads, p);
}

void FlashAttentionBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Tensor q = unit_last_stride(in[0]), k = unit_last_stride(in[1]),
               v = unit_last_stride(in[2]), y = unit_last_stride(in[3]);
  const float* lse = in[4].device_data<float>();  // (B, H, T) contiguous
  const Tensor dy = unit_last_stride(in[5]);      // (B, T, H, d)
  const int64_t B = q.size(0), H = q.size(1), G = group_of(q, k);
  const cpu::FlashParams p{q.size(2), k.size(2), q.size(3), scale_, causal_, q.dtype()};
  std::unique_ptr<ScratchBytes> kv_scratch;
  const GradTarget gt = grad_target(q, k, out[0], kv_scratch);
  std::vector<cpu::FlashHeadGrad> heads;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      heads.push_back({bh_ptr(q, b, h), bh_ptr(k, b, h / G), bh_ptr(v, b, h / G),
                       bh_ptr(y, b, h, true), bh_ptr(dy, b, h, true), lse + (b * H + h) * p.tq,
                       gt.dq(b, h), gt.dkv(b, h, 0), gt.dkv(b, h, 1), q.strides()[2],
                       k.strides()[2], v.strides()[2], y.strides()[1], dy.strides()[1], gt.ldq(),
                       gt.ldkv(), gt.ldkv()});
  cpu::flash_attention_backward(heads, p);
  if (kv_scratch) sum_kv_groups(gt, B, q.dtype());
}

}  // namespace kuai
