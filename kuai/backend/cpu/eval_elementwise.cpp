// CPU evaluation of the copy and elementwise primitives: strided copies, casts, concatenation,
// broadcasting binary ops (flat and row-broadcast fast paths, a strided general path), scale
// and GELU.
#include <omp.h>
#include <cstring>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/strided.h"
#include "kuai/backend/cpu/widen.h"
#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"

namespace kuai {

void Copy::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Tensor& x = in[0];
  cpu::copy_strided(x.device_ptr(), x.strides(), out[0].device_ptr(), out[0].strides(), x.shape(),
                    dtype_size(x.dtype()));
}

void Cast::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  convert(in[0].device_ptr(), in[0].dtype(), out[0].device_ptr(), to_, in[0].numel());
}

void Concat::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  Tensor& y = out[0];
  const int64_t es = dtype_size(y.dtype());
  int64_t start = 0;
  for (const Tensor& x : in) {
    char* dst = static_cast<char*>(y.device_ptr()) + start * y.strides()[dim_] * es;
    cpu::copy_strided(x.device_ptr(), x.strides(), dst, y.strides(), x.shape(), es);
    start += x.shape()[dim_];
  }
}

void NarrowBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  Tensor& y = out[0];
  const int64_t es = dtype_size(y.dtype());
  std::memset(y.device_ptr(), 0, static_cast<size_t>(y.nbytes()));
  char* dst = static_cast<char*>(y.device_ptr()) + start_ * y.strides()[dim_] * es;
  cpu::copy_strided(in[0].device_ptr(), in[0].strides(), dst, y.strides(), in[0].shape(), es);
}

namespace {

template <typename F>
void broadcast_loop(const Tensor& a, const Tensor& b, Tensor& y, F f) {
  // Strides of a and b broadcast to y's shape (0 on broadcast dims).
  const Shape& shape = y.shape();
  const size_t nd = shape.size();
  auto bstrides = [&](const Tensor& t) {
    Shape s(nd, 0);
    const size_t lead = nd - t.shape().size();
    for (size_t i = 0; i < t.shape().size(); ++i)
      s[lead + i] = t.shape()[i] == 1 ? 0 : t.strides()[i];
    return s;
  };
  Shape sh = shape, sa = bstrides(a), sb = bstrides(b), sy = y.strides();
  cpu::collapse_dims(sh, sa, sb, sy);
  const int64_t n = static_cast<int64_t>(sh.size());
  const int64_t inner = sh[n - 1];
  const int64_t rows = shape_numel(sh) / inner;
  const float* pa = a.device_data<float>();
  const float* pb = b.device_data<float>();
  float* py = y.device_data<float>();
#pragma omp parallel for schedule(static) if (rows * inner > (1 << 16) && rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t oa = 0, ob = 0, oy = 0, rem = r;
    for (int64_t k = n - 2; k >= 0; --k) {
      const int64_t idx = rem % sh[k];
      rem /= sh[k];
      oa += idx * sa[k];
      ob += idx * sb[k];
      oy += idx * sy[k];
    }
    for (int64_t i = 0; i < inner; ++i)
      py[oy + i * sy[n - 1]] = f(pa[oa + i * sa[n - 1]], pb[ob + i * sb[n - 1]]);
  }
}

// b's shape, without leading ones, equals the trailing dims of y: a row broadcast.
bool is_row_broadcast(const Tensor& b, const Tensor& y) {
  Shape s = b.shape();
  while (!s.empty() && s.front() == 1) s.erase(s.begin());
  if (s.size() > y.shape().size()) return false;
  return std::equal(s.begin(), s.end(), y.shape().end() - static_cast<int64_t>(s.size()));
}

}  // namespace

void Binary::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  if (!cpu::all_f32(in, out)) {
    if (in[0].shape() != in[1].shape()) return cpu::eval_widened(*this, in, out);
    if (op_ == BinaryOp::kAdd && out[0].dtype() == DType::kF32) {  // fp32 residual + bf16 branch
      for (int i = 0; i < 2; ++i)
        if (in[i].dtype() == DType::kF32 && in[1 - i].dtype() != DType::kF32)
          return cpu::add_f32_lowp(in[i].device_data<float>(), in[1 - i].device_data<uint16_t>(),
                                   out[0].device_data<float>(), out[0].numel(), in[1 - i].dtype());
    }
    const BinaryOp op = op_;
    cpu::map_widened<2>({&in[0], &in[1]}, out[0], [op](auto src, float* y, int64_t n) {
      switch (op) {
        case BinaryOp::kAdd:
          return cpu::add(src[0], src[1], y, n);
        case BinaryOp::kSub:
          return cpu::sub(src[0], src[1], y, n);
        case BinaryOp::kMul:
          return cpu::mul(src[0], src[1], y, n);
        case BinaryOp::kDiv:
          return cpu::div(src[0], src[1], y, n);
      }
    });
    return;
  }
  const Tensor& a = in[0];
  const Tensor& b = in[1];
  Tensor& y = out[0];
  const int64_t n = y.numel();
  if (a.shape() == b.shape()) {
    const float* pa = a.device_data<float>();
    const float* pb = b.device_data<float>();
    float* py = y.device_data<float>();
    switch (op_) {
      case BinaryOp::kAdd:
        cpu::add(pa, pb, py, n);
        return;
      case BinaryOp::kSub:
        cpu::sub(pa, pb, py, n);
        return;
      case BinaryOp::kMul:
        cpu::mul(pa, pb, py, n);
        return;
      case BinaryOp::kDiv:
        cpu::div(pa, pb, py, n);
        return;
    }
  }
  // Row broadcast fast path for the commutative ops (either operand may be the row).
  const Tensor* full = nullptr;
  const Tensor* row = nullptr;
  if (op_ == BinaryOp::kAdd || op_ == BinaryOp::kMul) {
    if (a.shape() == y.shape() && b.numel() > 0 && is_row_broadcast(b, y)) {
      full = &a;
      row = &b;
    } else if (b.shape() == y.shape() && a.numel() > 0 && is_row_broadcast(a, y)) {
      full = &b;
      row = &a;
    }
  }
  if (full != nullptr) {
    const int64_t cols = row->numel();
    if (op_ == BinaryOp::kAdd)
      cpu::add_row(full->device_data<float>(), row->device_data<float>(), y.device_data<float>(),
                   n / cols, cols);
    else
      cpu::mul_row(full->device_data<float>(), row->device_data<float>(), y.device_data<float>(),
                   n / cols, cols);
    return;
  }
  switch (op_) {
    case BinaryOp::kAdd:
      broadcast_loop(a, b, y, [](float u, float v) { return u + v; });
      return;
    case BinaryOp::kSub:
      broadcast_loop(a, b, y, [](float u, float v) { return u - v; });
      return;
    case BinaryOp::kMul:
      broadcast_loop(a, b, y, [](float u, float v) { return u * v; });
      return;
    case BinaryOp::kDiv:
      broadcast_loop(a, b, y, [](float u, float v) { return u / v; });
      return;
  }
}

void Scale::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  if (!cpu::all_f32(in, out))
    return cpu::map_widened<1>(
        {&in[0]}, out[0], [s = s_](auto src, float* y, int64_t n) { cpu::scale(src[0], s, y, n); });
  cpu::scale(in[0].device_data<float>(), s_, out[0].device_data<float>(), in[0].numel());
}

void Gelu::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  if (in[0].dtype() != DType::kF32)
    return cpu::gelu_forward_lowp(in[0].device_data<uint16_t>(), out[0].device_data<uint16_t>(),
                                  in[0].numel(), in[0].dtype());
  if (!cpu::all_f32(in, out))
    return cpu::map_widened<1>(
        {&in[0]}, out[0], [](auto src, float* y, int64_t n) { cpu::gelu_forward(src[0], y, n); });
  cpu::gelu_forward(in[0].device_data<float>(), out[0].device_data<float>(), in[0].numel());
}

void GeluBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  if (in[0].dtype() != DType::kF32 && in[1].dtype() == in[0].dtype())
    return cpu::gelu_backward_lowp(in[0].device_data<uint16_t>(), in[1].device_data<uint16_t>(),
                                   out[0].device_data<uint16_t>(), in[0].numel(), in[0].dtype());
  if (!cpu::all_f32(in, out))
    return cpu::map_widened<2>({&in[0], &in[1]}, out[0], [](auto src, float* dx, int64_t n) {
      cpu::gelu_backward(src[0], src[1], dx, n);
    });
  cpu::gelu_backward(in[0].device_data<float>(), in[1].device_data<float>(),
                     out[0].device_data<float>(), in[0].numel());
}

void Silu::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  cpu::silu_forward(in[0].device_ptr(), out[0].device_ptr(), in[0].numel(), in[0].dtype());
}

void SiluBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  cpu::silu_backward(in[0].device_ptr(), in[1].device_ptr(), out[0].device_ptr(), in[0].numel(),
                     in[0].dtype());
}

void SwiGLU::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t F = out[0].shape().empty() ? 1 : out[0].shape().back();
  cpu::swiglu_forward(in[0].device_ptr(), out[0].device_ptr(), F == 0 ? 0 : out[0].numel() / F, F,
                      in[0].dtype());
}

void SwiGLUBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t F = in[1].shape().empty() ? 1 : in[1].shape().back();
  cpu::swiglu_backward(in[0].device_ptr(), in[1].device_ptr(), out[0].device_ptr(),
                       F == 0 ? 0 : in[1].numel() / F, F, in[0].dtype());
}

void Rope::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  Tensor x = in[0];
  if (x.numel() > 0 && x.strides()[3] != 1) x = contiguous(x.detach());
  const Shape& st = x.strides();
  cpu::rope({x.device_ptr(), st[0], st[1], st[2], out[0].device_ptr(), x.size(0), x.size(1),
             x.size(2), x.size(3), rotated_heads_, pos0_, theta_, inverse_, x.dtype()});
}

void GeluBackwardSum::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t inner = in[0].shape().back();
  const int64_t n = inner == 0 ? 0 : in[0].numel() / inner;
  cpu::gelu_backward_sum(in[0].device_data<float>(), in[1].device_data<float>(),
                         out[0].device_data<float>(), out[1].device_data<float>(), n, inner);
}

void FusedElementwise::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t n = out[0].numel();
  if (n == 0) return;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), blocks));
  const size_t per_thread = (steps_.size() - 1) * static_cast<size_t>(kBlock);
  ScratchBytes scratch(static_cast<size_t>(scratch_bytes(threads)));  // on the calling thread
  float* buffers = static_cast<float*>(scratch.data());
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* mine = buffers + static_cast<size_t>(omp_get_thread_num()) * per_thread;
    std::vector<Tensor> results(steps_.size()), args;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kBlock, m = std::min(kBlock, n - begin);
      for (size_t j = 0; j < steps_.size(); ++j) {
        args.clear();
        for (int a : steps_[j].args)
          args.push_back(
              a >= 0 ? Tensor::borrow(in[static_cast<size_t>(a)].device_data<float>() + begin, {m},
                                      DType::kF32)
                     : results[static_cast<size_t>(-1 - a)]);
        float* dst = j + 1 == steps_.size() ? out[0].device_data<float>() + begin
                                            : mine + j * static_cast<size_t>(kBlock);
        results[j] = Tensor::borrow(dst, {m}, DType::kF32);
        steps_[j].op->eval_cpu(args, std::span<Tensor>(&results[j], 1));
      }
    }
  }
}

}  // namespace kuai
