// CPU evaluation of the creation ops (fill: full, zeros; arange; random draws) and of the in-place
// updates: the optimizers, gradient clipping and the fp16 loss scaler (kuai/core/primitives.h).
// Each reads its per-step numbers from its tensor inputs, where they live (on the CPU device: this
// memory), so the host never waits for a device value.
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/widen.h"
#include "kuai/core/primitives.h"
#include "kuai/core/rng.h"

namespace kuai {

void Fill::eval_cpu(std::span<const Tensor>, std::span<Tensor> out) const {
  Tensor& t = out[0];
  if (value_ == 0.0f) {
    std::memset(t.device_ptr(), 0, static_cast<size_t>(t.nbytes()));
  } else if (dtype_ == DType::kF32) {
    cpu::fill(t.device_data<float>(), value_, t.numel());
  } else {  // convert once, then replicate the element
    const int64_t es = dtype_size(dtype_);
    char one_value[8];
    convert(&value_, DType::kF32, one_value, dtype_, 1);
    char* p = static_cast<char*>(t.device_ptr());
    for (int64_t i = 0; i < t.numel(); ++i)
      std::memcpy(p + i * es, one_value, static_cast<size_t>(es));
  }
}

void Arange::eval_cpu(std::span<const Tensor>, std::span<Tensor> out) const {
  float* p = out[0].device_data<float>();
  for (int64_t i = 0; i < n_; ++i) p[i] = static_cast<float>(i);
}

void RandomFill::eval_cpu(std::span<const Tensor>, std::span<Tensor> out) const {
  Generator g(seed_, stream_);
  g.set_offset(offset_);
  Tensor& t = out[0];
  switch (kind_) {
    case Kind::kNormal:
      g.normal(t.device_data<float>(), t.numel(), static_cast<float>(a_), static_cast<float>(b_));
      return;
    case Kind::kUniform:
      g.uniform(t.device_data<float>(), t.numel(), static_cast<float>(a_), static_cast<float>(b_));
      return;
    case Kind::kInt:
      g.randint(t.device_data<int32_t>(), t.numel(), static_cast<int32_t>(a_),
                static_cast<int32_t>(b_));
      return;
  }
}

void AddInPlace::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  const Tensor& a = in[0];
  const Tensor& b = in[1];
  if (a.dtype() == DType::kF32 && b.dtype() == DType::kF32) {
    cpu::add(a.device_data<float>(), b.device_data<float>(), a.device_data<float>(), a.numel());
    return;
  }
  // Low precision (a gradient accumulated in bf16 / f16): fp32 sum, one rounding into a.
  cpu::map_widened<2>({&a, &b}, a,
                      [](auto src, float* y, int64_t n) { cpu::add(src[0], src[1], y, n); });
}

void AdvanceStep::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (in[1].device_data<float>()[0] == 0.0f) ++in[0].device_data<int64_t>()[0];  // NaN: skipped too
}

void AdamWHyper::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const double t = static_cast<double>(in[0].device_data<int64_t>()[0]);
  float* h = out[0].device_data<float>();
  h[0] = in[1].device_data<float>()[0];
  h[1] = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1_), t));
  h[2] = static_cast<float>(1.0 - std::pow(static_cast<double>(beta2_), t));
}

void AdamWUpdate::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (in[6].device_data<float>()[0] != 0.0f) return;  // skipped (NaN too)
  const float* hyper = in[4].device_data<float>();
  cpu::AdamWParams hp{};
  hp.lr = hyper[0];
  hp.beta1 = beta1_;
  hp.beta2 = beta2_;
  hp.eps = eps_;
  hp.weight_decay = weight_decay_;
  hp.bias_correction1 = hyper[1];
  hp.bias_correction2 = hyper[2];
  hp.grad_scale = in[5].device_data<float>()[0];
  cpu::adamw_step(in[0].device_data<float>(), in[1].device_data<float>(),
                  in[2].device_data<float>(), in[3].device_data<float>(), in[0].numel(), hp);
}

void SgdUpdate::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (in[6].device_data<float>()[0] != 0.0f) return;
  const bool first = in[3].device_data<int64_t>()[0] == 1;
  cpu::sgd_step(in[0].device_data<float>(), in[1].device_data<float>(), in[2].device_data<float>(),
                in[0].numel(), in[4].device_data<float>()[0], momentum_, dampening_, weight_decay_,
                nesterov_, first, in[5].device_data<float>()[0]);
}

void GradNorm::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  double total = 0.0;
  for (const Tensor& g : in) total += cpu::sum_squares(g.device_data<float>(), g.numel());
  out[0].device_data<float>()[0] = static_cast<float>(std::sqrt(total));
}

void SumSquaresBits::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const double s =
      in[0].numel() > 0 ? cpu::sum_squares(in[0].device_data<float>(), in[0].numel()) : 0.0;
  out[0].device_data<int64_t>()[0] = std::bit_cast<int64_t>(s);
}

void NormOfPartialSums::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  double total = 0.0;
  const int64_t* bits = in[0].device_data<int64_t>();
  for (int64_t r = 0; r < in[0].numel(); ++r) total += std::bit_cast<double>(bits[r]);
  out[0].device_data<float>()[0] = static_cast<float>(std::sqrt(total));
}

void ClipCoefficient::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  float c = 1.0f;
  if (max_norm_ > 0) {
    const double r = static_cast<double>(max_norm_) /
                     (static_cast<double>(in[0].device_data<float>()[0]) + 1e-6);
    if (r < 1.0) c = static_cast<float>(r);
  }
  out[0].device_data<float>()[0] = c;
}

void ZeroInPlace::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  std::memset(in[0].device_ptr(), 0, static_cast<size_t>(in[0].nbytes()));
}

void AssignInPlace::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  if (in[0].device_ptr() != in[1].device_ptr())
    std::memcpy(in[0].device_ptr(), in[1].device_ptr(), static_cast<size_t>(in[0].nbytes()));
}

void ScaleInPlace::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  cpu::scale(in[0].device_data<float>(), c_, in[0].device_data<float>(), in[0].numel());
}

void UnscaleAndCheck::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  // Powers of two (the defaults) give an exact reciprocal; otherwise rounded once, as PyTorch's
  // scale.double().reciprocal().float().
  const float inv = static_cast<float>(1.0 / static_cast<double>(in[1].device_data<float>()[0]));
  cpu::unscale_and_check(in[0].device_data<float>(), in[0].numel(), inv,
                         in[2].device_data<float>());
}

void ScalerUpdate::eval_cpu(std::span<const Tensor> in, std::span<Tensor>) const {
  float& scale = in[0].device_data<float>()[0];
  int64_t& tracker = in[1].device_data<int64_t>()[0];
  if (in[2].device_data<float>()[0] != 0.0f) {  // NaN too
    scale = std::max(scale * backoff_, FLT_MIN);
    tracker = 0;
    return;
  }
  if (++tracker < growth_interval_) return;
  const float grown = scale * growth_;
  if (std::isfinite(grown)) scale = grown;
  tracker = 0;
}

}  // namespace kuai
