// CPU evaluation of matmul and linear. Operands may be strided views: any matrix whose rows or
// columns are unit-stride maps onto a BLAS layout (a transpose flag and a leading dimension),
// so q/k/v slices and transposed weights are multiplied in place without copies. Batches become
// one tall GEMM when the rows of every batch are evenly spaced, else a batched call.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/widen.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"

namespace kuai {
namespace {

struct MatLayout {
  bool trans;  // stored column-major (the matrix is a transposed row-major block)
  int64_t ld;
};

// Layout of the last two dims of t as a BLAS operand, if there is one.
std::optional<MatLayout> mat_layout(const Tensor& t) {
  const int64_t rows = t.shape()[t.dim() - 2], cols = t.shape()[t.dim() - 1];
  const int64_t rs = t.strides()[t.dim() - 2], cs = t.strides()[t.dim() - 1];
  if (rows == 0 || cols == 0) return MatLayout{false, std::max<int64_t>(1, cols)};  // no elements
  if ((cs == 1 || cols == 1) && (rows == 1 || rs >= std::max<int64_t>(1, cols)))
    return MatLayout{false, rows == 1 ? std::max<int64_t>(1, cols) : rs};
  if ((rs == 1 || rows == 1) && (cols == 1 || cs >= std::max<int64_t>(1, rows)))
    return MatLayout{true, cols == 1 ? std::max<int64_t>(1, rows) : cs};
  return std::nullopt;
}

// Element offsets of every matrix of the batch dims of t (which has `batch_dims` of them,
// matching `shape`), or all zeros when t has no batch dims.
std::vector<int64_t> batch_offsets(const Tensor& t, const Shape& batch_shape) {
  const int64_t count = shape_numel(batch_shape);
  std::vector<int64_t> off(count, 0);
  if (t.dim() == 2) return off;
  const int64_t nb = static_cast<int64_t>(batch_shape.size());
  for (int64_t i = 0; i < count; ++i) {
    int64_t rem = i, o = 0;
    for (int64_t k = nb - 1; k >= 0; --k) {
      o += (rem % batch_shape[k]) * t.strides()[k];
      rem /= batch_shape[k];
    }
    off[i] = o;
  }
  return off;
}

// Whether the batch dims of t fold into its rows: row-major with every batch step equal to the
// rows it covers.
bool folds_into_rows(const Tensor& t, const MatLayout& l) {
  if (l.trans) return false;
  int64_t expected = t.shape()[t.dim() - 2] * l.ld;
  for (int64_t k = t.dim() - 3; k >= 0; --k) {
    if (t.shape()[k] != 1 && t.strides()[k] != expected) return false;
    expected *= t.shape()[k];
  }
  return true;
}

}  // namespace

void Matmul::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  Tensor a = in[0], b = in[1];
  Tensor& y = out[0];
  std::optional<MatLayout> la = mat_layout(a), lb = mat_layout(b);
  if (!la) {
    a = contiguous(a.detach());
    la = mat_layout(a);
  }
  if (!lb) {
    b = contiguous(b.detach());
    lb = mat_layout(b);
  }
  const int64_t M = a.shape()[a.dim() - 2], K = a.shape()[a.dim() - 1], N = b.shape().back();
  const Shape batch_shape(y.shape().begin(), y.shape().end() - 2);
  const int64_t batch = shape_numel(batch_shape);
  if (y.numel() == 0) return;
  if (a.dtype() != DType::kF32) {  // bf16 / f16 operands, fp32 accumulation (gemm_lowp.h)
    const DType t = a.dtype();
    if (b.dim() == 2 && folds_into_rows(a, *la))
      cpu::gemm_lowp(false, lb->trans, M * batch, N, K, 1.0f, a.device_ptr(), t, la->ld,
                     b.device_ptr(), t, lb->ld, 0.0f, y.device_ptr(), t, N);
    else if (batch == 1)
      cpu::gemm_lowp(la->trans, lb->trans, M, N, K, 1.0f, a.device_ptr(), t, la->ld, b.device_ptr(),
                     t, lb->ld, 0.0f, y.device_ptr(), t, N);
    else
      cpu::eval_widened(*this, in, out);  // batched low-precision products: through fp32
    return;
  }
  const float* pa = a.device_data<float>();
  const float* pb = b.device_data<float>();
  float* py = y.device_data<float>();
  if (b.dim() == 2 && folds_into_rows(a, *la)) {
    cpu::gemm(false, lb->trans, M * batch, N, K, 1.0f, pa, la->ld, pb, lb->ld, 0.0f, py, N);
    return;
  }
  if (batch == 1) {
    cpu::gemm(la->trans, lb->trans, M, N, K, 1.0f, pa, la->ld, pb, lb->ld, 0.0f, py, N);
    return;
  }
  std::vector<int64_t> oa = batch_offsets(a, batch_shape), ob = batch_offsets(b, batch_shape);
  std::vector<int64_t> oy(batch);
  for (int64_t i = 0; i < batch; ++i) oy[i] = i * M * N;
  cpu::gemm_batched(la->trans, lb->trans, M, N, K, 1.0f, pa, la->ld, oa.data(), pb, lb->ld,
                    ob.data(), 0.0f, py, N, oy.data(), batch);
}

// The scratch of the fp32 product eval_cpu runs, when kuai's blocked GEMM runs it (gemm.h); a
// batch of products takes one product's at a time.
std::vector<int64_t> Matmul::cpu_scratch(std::span<const Tensor> in,
                                         std::span<const Tensor> out) const {
  const Tensor &a = in[0], &b = in[1];
  if (a.dtype() != DType::kF32 || out[0].numel() == 0) return {};
  std::optional<MatLayout> la = mat_layout(a), lb = mat_layout(b);
  const int64_t M = a.shape()[a.dim() - 2], K = a.shape()[a.dim() - 1], N = b.shape().back();
  const int64_t batch = out[0].numel() / (M * N);
  // An operand eval_cpu first copies to contiguous (a tensor, not scratch) is not transposed,
  // and a contiguous A folds into rows.
  const bool ta = la && la->trans, tb = lb && lb->trans;
  if (b.dim() == 2 && (!la || folds_into_rows(a, *la)))
    return cpu::gemm_scratch_bytes("gemm", false, tb, M * batch, N, K);
  return cpu::gemm_scratch_bytes("gemm", ta, tb, M, N, K);
}

std::vector<int64_t> Linear::cpu_scratch(std::span<const Tensor> in,
                                         std::span<const Tensor> out) const {
  const Tensor &x = in[0], &w = in[1];
  const int64_t N = w.shape()[0], K = w.shape()[1];
  if (x.dtype() != DType::kF32 || out[0].numel() == 0) return {};
  return cpu::gemm_scratch_bytes(in.size() == 3 ? "bias" : "gemm", false, true, out[0].numel() / N,
                                 N, K);
}

void Linear::eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const {
  const Tensor& x = in[0];
  const Tensor& w = in[1];
  Tensor& y = out[0];
  const int64_t N = w.shape()[0], K = w.shape()[1];
  if (y.numel() == 0) return;
  const int64_t R = y.numel() / N;  // gemm and gemm_bias handle K == 0 (zeros, or the bias)
  if (x.dtype() != DType::kF32) {
    // bf16 / f16: fp32 accumulation, the bias added in fp32, y rounded once.
    const DType t = x.dtype();
    if (in.size() == 3)
      cpu::gemm_lowp_bias(false, true, R, N, K, x.device_ptr(), t, K, w.device_ptr(), t, K,
                          in[2].device_ptr(), t, y.device_ptr(), t, N);
    else
      cpu::gemm_lowp(false, true, R, N, K, 1.0f, x.device_ptr(), t, K, w.device_ptr(), t, K, 0.0f,
                     y.device_ptr(), t, N);
    return;
  }
  if (in.size() == 3)
    cpu::gemm_bias(false, true, R, N, K, x.device_data<float>(), K, w.device_data<float>(), K,
                   in[2].device_data<float>(), y.device_data<float>(), N);
  else
    cpu::gemm(false, true, R, N, K, 1.0f, x.device_data<float>(), K, w.device_data<float>(), K,
              0.0f, y.device_data<float>(), N);
}

}  // namespace kuai
