// CPU evaluation of the normalisation, softmax, embedding and loss primitives: thin adapters
// from tensors to the raw kernels, plus the checks the kernels leave to their callers.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include <vector>
#include "kuai/backend/cpu/convert.h"
#include "kuai/core/allocator.h"

#include "kuai/backend/cpu/kernels.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"

namespace kuai {

void Softmax::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t cols = in[0].shape().back();
  const int64_t rows = cols == 0 ? 0 : in[0].numel() / cols;
  cpu::softmax_forward(in[0].device_data<float>(), out[0].device_data<float>(), rows, cols, scale_,
                       causal_);
}

void SoftmaxBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t cols = in[0].shape().back();
  const int64_t rows = cols == 0 ? 0 : in[0].numel() / cols;
  cpu::softmax_backward(in[0].device_data<float>(), in[1].device_data<float>(),
                        out[0].device_data<float>(), rows, cols, scale_);
}

void LayerNorm::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  const int64_t N = out[1].numel();
  cpu::layer_norm_forward(in[0].device_data<float>(), in[1].device_data<float>(),
                          in[2].device_data<float>(), out[0].device_data<float>(),
                          out[1].device_data<float>(), out[2].device_data<float>(), N, C, eps_);
}

void AddLayerNorm::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  const int64_t N = out[2].numel();
  cpu::add_layer_norm_forward(in[0].device_data<float>(), in[1].device_ptr(), in[1].dtype(),
                              out[0].device_data<float>(), in[2].device_data<float>(),
                              in[3].device_data<float>(), out[1].device_data<float>(),
                              out[2].device_data<float>(), out[3].device_data<float>(), N, C, eps_);
}

void LayerNormBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  const int64_t N = in[2].numel();
  cpu::layer_norm_backward(in[4].device_data<float>(), in[0].device_data<float>(),
                           in[1].device_data<float>(), in[2].device_data<float>(),
                           in[3].device_data<float>(), out[0].device_data<float>(),
                           out[1].device_data<float>(), out[2].device_data<float>(), N, C);
}

void RMSNorm::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  cpu::rms_norm_forward(in[0].device_data<float>(), in[1].device_data<float>(),
                        out[0].device_data<float>(), out[1].device_data<float>(), out[1].numel(), C,
                        eps_);
}

void RMSNormBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  cpu::rms_norm_backward(in[3].device_data<float>(), in[0].device_data<float>(),
                         in[1].device_data<float>(), in[2].device_data<float>(),
                         out[0].device_data<float>(), out[1].device_data<float>(), in[2].numel(),
                         C);
}

void LayerNormBackwardAdd::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = in[0].shape().back();
  const int64_t N = in[2].numel();
  cpu::layer_norm_backward_add(in[4].device_data<float>(), in[0].device_data<float>(),
                               in[1].device_data<float>(), in[2].device_data<float>(),
                               in[3].device_data<float>(), in[5].device_data<float>(),
                               out[0].device_data<float>(), out[1].device_data<float>(), N, C);
}

namespace {
void check_indices(std::string_view op, const Tensor& idx, int64_t limit, int32_t ignore) {
  const int32_t* p = idx.device_data<int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    if ((p[i] < 0 || p[i] >= limit) && p[i] != ignore)
      throw std::out_of_range(
          fmt::format("{}: index {} at position {} is outside [0, {})", op, p[i], i, limit));
}
}  // namespace

void Embedding::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t V = in[0].shape()[0], C = in[0].shape()[1];
  check_indices(name(), in[1], V, 0);
  cpu::embedding_forward(in[0].device_data<float>(), in[1].device_data<int32_t>(),
                         out[0].device_data<float>(), in[1].numel(), C);
}

void EmbeddingBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t C = out[0].shape()[1];
  cpu::embedding_backward(in[1].device_data<float>(), in[0].device_data<int32_t>(),
                          out[0].device_data<float>(), in[0].numel(), C, num_);
}

namespace {

// Low-precision logits are processed in chunks of rows of about kChunkElements, each widened
// into its thread's fp32 buffer (cache-resident), computed in fp32 and, for the gradient, rounded
// straight back: one read of the bf16 logits and one write of the bf16 gradient go through
// memory, and no fp32 copy of the (N, V) logits exists. The buffers (threads x chunk) are one
// tensor, so the allocator counts them.
constexpr int64_t kChunkElements = int64_t{1} << 16;

// Rows per chunk of an (N, V) matrix (N > 0).
int64_t chunk_rows(int64_t N, int64_t V) {
  return std::min(N, std::max<int64_t>(1, kChunkElements / std::max<int64_t>(1, V)));
}

const char* row_ptr(const Tensor& t, int64_t row) {
  return static_cast<const char*>(t.device_ptr()) + row * t.shape()[1] * dtype_size(t.dtype());
}

// Calls fn(c, r0, n, buf) for every chunk c of rows [r0, r0 + n), in parallel, with buf the
// calling thread's fp32 buffer holding the widened logits of the chunk.
template <class Fn>
void for_widened_chunks(const Tensor& logits, Fn&& fn) {
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  if (N <= 0) return;
  const int64_t rows = chunk_rows(N, V), chunks = (N + rows - 1) / rows;
  const int threads = std::max(1, std::min<int>(omp_get_max_threads(), static_cast<int>(chunks)));
  ScratchFloats buffers(threads * rows * V);  // taken on the calling thread
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t r0 = c * rows, n = std::min(rows, N - r0);
    float* buf = buffers.data() + omp_get_thread_num() * rows * V;
    convert_serial(row_ptr(logits, r0), logits.dtype(), buf, DType::kF32, n * V);
    fn(c, r0, n, buf);
  }
}

}  // namespace

void CrossEntropy::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t N = in[0].shape()[0], V = in[0].shape()[1];
  check_indices(name(), in[1], V, ignore_);
  int64_t count = 0;
  double total = 0.0;
  if (in[0].dtype() == DType::kF32) {
    total = cpu::cross_entropy_forward(in[0].device_data<float>(), in[1].device_data<int32_t>(),
                                       out[1].device_data<float>(), N, V, ignore_, &count);
  } else {
    // Per-chunk sums, added in chunk order: the loss does not depend on the thread count.
    const int64_t chunks = N > 0 ? (N + chunk_rows(N, V) - 1) / chunk_rows(N, V) : 0;
    std::vector<double> totals(static_cast<size_t>(chunks));
    std::vector<int64_t> counts(static_cast<size_t>(chunks));
    for_widened_chunks(in[0], [&](int64_t c, int64_t r0, int64_t n, float* buf) {
      totals[c] =
          cpu::cross_entropy_forward(buf, in[1].device_data<int32_t>() + r0,
                                     out[1].device_data<float>() + r0, n, V, ignore_, &counts[c]);
    });
    for (int64_t c = 0; c < chunks; ++c) {
      total += totals[c];
      count += counts[c];
    }
  }
  out[0].device_data<float>()[0] = count > 0
                                       ? static_cast<float>(total / static_cast<double>(count))
                                       : std::numeric_limits<float>::quiet_NaN();
  out[2].device_data<float>()[0] = static_cast<float>(count);
}

void CrossEntropyBackward::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t N = in[0].shape()[0], V = in[0].shape()[1];
  const float count = in[3].device_data<float>()[0];
  const float grad_scale = cpu::cross_entropy_grad_scale(in[4].device_data<float>()[0], count);
  if (in[0].dtype() == DType::kF32) {
    cpu::cross_entropy_backward(in[0].device_data<float>(), in[1].device_data<int32_t>(),
                                in[2].device_data<float>(), out[0].device_data<float>(), N, V,
                                ignore_, grad_scale);
    return;
  }
  // Low precision: fp32 softmax and gradient per chunk of rows, rounded once into dlogits.
  const DType t = in[0].dtype();
  for_widened_chunks(in[0], [&](int64_t, int64_t r0, int64_t n, float* buf) {
    cpu::cross_entropy_backward(buf, in[1].device_data<int32_t>() + r0,
                                in[2].device_data<float>() + r0, buf, n, V, ignore_, grad_scale);
    convert_serial(buf, DType::kF32, const_cast<char*>(row_ptr(out[0], r0)), t, n * V);
  });
}

void CrossEntropyWithGrad::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const int64_t N = in[0].shape()[0], V = in[0].shape()[1];
  check_indices(name(), in[1], V, ignore_);
  // The rows that count are known from the targets, so the backward's scale is too, before any
  // logit is read: the same float the separate backward computes from the forward's count.
  const int32_t* targets = in[1].device_data<int32_t>();
  int64_t count = 0;
  for (int64_t i = 0; i < N; ++i) count += targets[i] != ignore_;
  const float grad_scale =
      cpu::cross_entropy_grad_scale(in[2].device_data<float>()[0], static_cast<float>(count));
  double total = 0.0;
  if (in[0].dtype() == DType::kF32) {
    total = cpu::cross_entropy_forward_backward(
        in[0].device_data<float>(), targets, out[1].device_data<float>(),
        out[3].device_data<float>(), N, V, ignore_, grad_scale);
  } else {
    // CrossEntropy's and CrossEntropyBackward's chunks, each widened once: its loss and lse
    // from the fp32 rows, then its gradient over them, rounded once into dlogits.
    const int64_t chunks = N > 0 ? (N + chunk_rows(N, V) - 1) / chunk_rows(N, V) : 0;
    std::vector<double> totals(static_cast<size_t>(chunks));
    const DType t = in[0].dtype();
    for_widened_chunks(in[0], [&](int64_t c, int64_t r0, int64_t n, float* buf) {
      totals[c] = cpu::cross_entropy_forward(buf, targets + r0, out[1].device_data<float>() + r0, n,
                                             V, ignore_, nullptr);
      cpu::cross_entropy_backward(buf, targets + r0, out[1].device_data<float>() + r0, buf, n, V,
                                  ignore_, grad_scale);
      convert_serial(buf, DType::kF32, const_cast<char*>(row_ptr(out[3], r0)), t, n * V);
    });
    for (int64_t c = 0; c < chunks; ++c) total += totals[c];
  }
  out[0].device_data<float>()[0] = count > 0
                                       ? static_cast<float>(total / static_cast<double>(count))
                                       : std::numeric_limits<float>::quiet_NaN();
  out[2].device_data<float>()[0] = static_cast<float>(count);
}

}  // namespace kuai
