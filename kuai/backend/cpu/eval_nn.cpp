// CPU evaluation of the normalisation, softmax, embedding and loss primitives: thin adapters
// from tensors to the raw kernels, plus the checks the kernels leave to their callers.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "kuai/backend/cpu/kernels.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"

namespace kuai {

void Softmax::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t cols = in[0].shape().back();
  const int64_t rows = cols == 0 ? 0 : in[0].numel() / cols;
  cpu::softmax_forward(in[0].data<float>(), out[0].data<float>(), rows, cols, scale_, causal_);
}

void SoftmaxBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t cols = in[0].shape().back();
  const int64_t rows = cols == 0 ? 0 : in[0].numel() / cols;
  cpu::softmax_backward(in[0].data<float>(), in[1].data<float>(), out[0].data<float>(), rows, cols,
                        scale_);
}

void LayerNorm::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  const int64_t N = out[1].numel();
  cpu::layer_norm_forward(in[0].data<float>(), in[1].data<float>(), in[2].data<float>(),
                          out[0].data<float>(), out[1].data<float>(), out[2].data<float>(), N, C,
                          eps_);
}

void LayerNormBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  const int64_t N = in[2].numel();
  cpu::layer_norm_backward(in[4].data<float>(), in[0].data<float>(), in[1].data<float>(),
                           in[2].data<float>(), in[3].data<float>(), out[0].data<float>(),
                           out[1].data<float>(), out[2].data<float>(), N, C);
}

namespace {
void check_indices(std::string_view op, const Tensor& idx, int64_t limit, int32_t ignore) {
  const int32_t* p = idx.data<int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    if ((p[i] < 0 || p[i] >= limit) && p[i] != ignore)
      throw std::out_of_range(
          fmt::format("{}: index {} at position {} is outside [0, {})", op, p[i], i, limit));
}
}  // namespace

void Embedding::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t V = in[0].shape()[0], C = in[0].shape()[1];
  check_indices(name(), in[1], V, 0);
  cpu::embedding_forward(in[0].data<float>(), in[1].data<int32_t>(), out[0].data<float>(),
                         in[1].numel(), C);
}

void EmbeddingBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = out[0].shape()[1];
  cpu::embedding_backward(in[1].data<float>(), in[0].data<int32_t>(), out[0].data<float>(),
                          in[0].numel(), C, num_);
}

namespace {

// Low-precision logits are widened a block of rows at a time (at most kWidenBlock elements), so
// cross-entropy under autocast never holds an fp32 copy of the whole (N, V) logits.
constexpr int64_t kWidenBlock = int64_t{1} << 22;

int64_t widen_rows(int64_t V) {
  return std::max<int64_t>(1, kWidenBlock / std::max<int64_t>(1, V));
}

const char* row_ptr(const Tensor& t, int64_t row) {
  return static_cast<const char*>(t.raw_data()) + row * t.shape()[1] * dtype_size(t.dtype());
}

}  // namespace

void CrossEntropy::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t N = in[0].shape()[0], V = in[0].shape()[1];
  check_indices(name(), in[1], V, ignore_);
  int64_t count = 0;
  double total = 0.0;
  if (in[0].dtype() == DType::kF32) {
    total = cpu::cross_entropy_forward(in[0].data<float>(), in[1].data<int32_t>(),
                                       out[1].data<float>(), N, V, ignore_, &count);
  } else {
    const int64_t rows = std::min(N, widen_rows(V));
    Tensor block = Tensor::empty({rows, V}, DType::kF32, in[0].device());
    for (int64_t r0 = 0; r0 < N; r0 += rows) {
      const int64_t n = std::min(rows, N - r0);
      convert(row_ptr(in[0], r0), in[0].dtype(), block.raw_data(), DType::kF32, n * V);
      int64_t c = 0;
      total += cpu::cross_entropy_forward(block.data<float>(), in[1].data<int32_t>() + r0,
                                          out[1].data<float>() + r0, n, V, ignore_, &c);
      count += c;
    }
  }
  out[0].data<float>()[0] = count > 0 ? static_cast<float>(total / static_cast<double>(count))
                                      : std::numeric_limits<float>::quiet_NaN();
  out[2].data<float>()[0] = static_cast<float>(count);
}

void CrossEntropyBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t N = in[0].shape()[0], V = in[0].shape()[1];
  const float count = in[3].data<float>()[0];
  const float grad_scale = count > 0 ? in[4].data<float>()[0] / count : 0.0f;
  if (in[0].dtype() == DType::kF32) {
    cpu::cross_entropy_backward(in[0].data<float>(), in[1].data<int32_t>(), in[2].data<float>(),
                                out[0].data<float>(), N, V, ignore_, grad_scale);
    return;
  }
  // Low precision: fp32 softmax and gradient per block of rows, rounded once into dlogits.
  const DType t = in[0].dtype();
  const int64_t rows = std::min(N, widen_rows(V));
  Tensor block = Tensor::empty({rows, V}, DType::kF32, in[0].device());
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t n = std::min(rows, N - r0);
    convert(row_ptr(in[0], r0), t, block.raw_data(), DType::kF32, n * V);
    cpu::cross_entropy_backward(block.data<float>(), in[1].data<int32_t>() + r0,
                                in[2].data<float>() + r0, block.data<float>(), n, V, ignore_,
                                grad_scale);
    convert(block.raw_data(), DType::kF32, const_cast<char*>(row_ptr(out[0], r0)), t, n * V);
  }
}

}  // namespace kuai
