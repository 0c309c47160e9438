// CPU evaluation of the normalisation, softmax, embedding and loss primitives: thin adapters
// from tensors to the raw kernels, plus the checks the kernels leave to their callers.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "kuai/backend/cpu/kernels.h"
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

void CrossEntropy::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t N = in[0].shape()[0], V = in[0].shape()[1];
  check_indices(name(), in[1], V, ignore_);
  int64_t count = 0;
  const double total = cpu::cross_entropy_forward(in[0].data<float>(), in[1].data<int32_t>(),
                                                  out[1].data<float>(), N, V, ignore_, &count);
  out[0].data<float>()[0] = count > 0 ? static_cast<float>(total / static_cast<double>(count))
                                      : std::numeric_limits<float>::quiet_NaN();
  out[2].data<float>()[0] = static_cast<float>(count);
}

void CrossEntropyBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t N = in[0].shape()[0], V = in[0].shape()[1];
  const float count = in[3].data<float>()[0];
  const float grad_scale = count > 0 ? in[4].data<float>()[0] / count : 0.0f;
  cpu::cross_entropy_backward(in[0].data<float>(), in[1].data<int32_t>(), in[2].data<float>(),
                              out[0].data<float>(), N, V, ignore_, grad_scale);
}

}  // namespace kuai
