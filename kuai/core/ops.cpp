// The op library (see ops.h): argument normalisation, then one primitive through dispatch().
#include "kuai/core/ops.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "kuai/core/dispatch.h"
#include "kuai/core/primitives.h"
#include "kuai/core/shape_util.h"

namespace kuai {
namespace {

Tensor run1(std::shared_ptr<const Primitive> p, std::vector<Tensor> in) {
  return dispatch(std::move(p), std::move(in))[0];
}

}  // namespace

// ---- creation ----

Tensor full(const Shape& shape, float value, DType dtype, Device device) {
  return dispatch(std::make_shared<Fill>(shape, dtype, value, device), {})[0];
}

void fill_(const Tensor& t, float value) {
  if (!t.is_contiguous())
    throw std::invalid_argument("fill_: needs a contiguous tensor, got " + t.str());
  std::vector<Tensor> out = {t};
  evaluate(Fill(t.shape(), t.dtype(), value, t.device()), {}, out);
}

Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return dispatch(std::make_shared<Fill>(shape, dtype, 0.0f, device), {})[0];
}

namespace {
template <typename T>
Tensor tensor_from(const std::vector<T>& values, const Shape& shape, DType dtype, Device device) {
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    throw std::invalid_argument(
        fmt::format("from_vector: {} values for shape {}", values.size(), shape_str(shape)));
  Tensor t = Tensor::empty(shape, dtype, device);
  t.copy_from_host(values.data(), values.size() * sizeof(T));
  return t;
}
}  // namespace

Tensor from_vector(const std::vector<float>& values, const Shape& shape, Device device) {
  return tensor_from(values, shape, DType::kF32, device);
}

Tensor from_vector(const std::vector<int32_t>& values, const Shape& shape, Device device) {
  return tensor_from(values, shape, DType::kI32, device);
}

Tensor arange(int64_t n, DType dtype, Device device) {
  Tensor t = dispatch(std::make_shared<Arange>(n, device), {})[0];
  return dtype == DType::kF32 ? t : cast(t, dtype);
}

// ---- views ----

Tensor reshape(const Tensor& x, Shape shape) {
  int64_t known = 1, infer_at = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer_at >= 0) throw std::invalid_argument("reshape: more than one -1 in the shape");
      infer_at = static_cast<int64_t>(i);
    } else {
      known *= shape[i];
    }
  }
  if (infer_at >= 0) shape[infer_at] = known == 0 ? 0 : x.numel() / known;
  if (shape_numel(shape) != x.numel())
    throw std::invalid_argument(
        fmt::format("reshape: cannot view {} as {}", shape_str(x.shape()), shape_str(shape)));
  if (shape == x.shape()) return x;
  if (auto strides = view_strides(x.shape(), x.strides(), shape))
    return run1(std::make_shared<View>(shape, *strides), {x});
  return run1(std::make_shared<View>(shape, contiguous_strides(shape)), {contiguous(x)});
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  if (static_cast<int64_t>(dims.size()) != x.dim())
    throw std::invalid_argument(fmt::format("permute: {} dims for {}", dims.size(), x.str()));
  std::vector<int64_t> d(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    d[i] = normalize_dim("permute", dims[i], x.dim());
    if (seen[d[i]]) throw std::invalid_argument("permute: repeated dim");
    seen[d[i]] = true;
  }
  return run1(std::make_shared<Permute>(std::move(d)), {x});
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  d0 = normalize_dim("transpose", d0, x.dim());
  d1 = normalize_dim("transpose", d1, x.dim());
  std::vector<int64_t> dims(x.dim());
  for (int64_t i = 0; i < x.dim(); ++i) dims[i] = i;
  std::swap(dims[d0], dims[d1]);
  return run1(std::make_shared<Permute>(std::move(dims)), {x});
}

Tensor expand(const Tensor& x, const Shape& shape) {
  if (shape == x.shape()) return x;
  if (broadcast_shapes("expand", x.shape(), shape) != shape)
    throw std::invalid_argument(
        fmt::format("expand: cannot expand {} to {}", shape_str(x.shape()), shape_str(shape)));
  return run1(std::make_shared<Expand>(shape), {x});
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  dim = normalize_dim("chunk", dim, x.dim());
  if (chunks <= 0 || x.shape()[dim] % chunks != 0)
    throw std::invalid_argument(fmt::format("chunk: dim {} of size {} does not split into {}", dim,
                                            x.shape()[dim], chunks));
  return dispatch(std::make_shared<Chunk>(chunks, dim), {x});
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  dim = normalize_dim("split", dim, x.dim());
  int64_t total = 0;
  for (int64_t n : sizes) {
    if (n < 0) throw std::invalid_argument(fmt::format("split: negative size {}", n));
    total += n;
  }
  if (total != x.shape()[dim])
    throw std::invalid_argument(fmt::format("split: sizes [{}] do not add up to dim {} of {}",
                                            fmt::join(sizes, ", "), dim, x.str()));
  return dispatch(std::make_shared<Split>(sizes, dim), {x});
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  dim = normalize_dim("narrow", dim, x.dim());
  if (start < 0 || length < 0 || start + length > x.shape()[dim])
    throw std::invalid_argument(
        fmt::format("narrow: [{}, {}) outside dim {} of {}", start, start + length, dim, x.str()));
  return run1(std::make_shared<Narrow>(dim, start, length), {x});
}

// ---- copies ----

Tensor contiguous(const Tensor& x) { return run1(std::make_shared<Copy>(), {x}); }
Tensor clone(const Tensor& x) { return run1(std::make_shared<Copy>(), {x}); }
Tensor cast(const Tensor& x, DType dtype) { return run1(std::make_shared<Cast>(dtype), {x}); }

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  if (xs.empty()) throw std::invalid_argument("cat: no tensors");
  dim = normalize_dim("cat", dim, xs[0].dim());
  return run1(std::make_shared<Concat>(dim), xs);
}

// ---- elementwise ----

Tensor add(const Tensor& a, const Tensor& b) {
  return run1(std::make_shared<Binary>(BinaryOp::kAdd), {a, b});
}
Tensor sub(const Tensor& a, const Tensor& b) {
  return run1(std::make_shared<Binary>(BinaryOp::kSub), {a, b});
}
Tensor mul(const Tensor& a, const Tensor& b) {
  return run1(std::make_shared<Binary>(BinaryOp::kMul), {a, b});
}
Tensor div(const Tensor& a, const Tensor& b) {
  return run1(std::make_shared<Binary>(BinaryOp::kDiv), {a, b});
}
Tensor scale(const Tensor& x, float s) { return run1(std::make_shared<Scale>(s), {x}); }
Tensor gelu(const Tensor& x) { return run1(std::make_shared<Gelu>(), {x}); }
Tensor gelu_backward(const Tensor& x, const Tensor& grad) {
  return run1(std::make_shared<GeluBackward>(), {x, grad});
}

Tensor silu(const Tensor& x) { return run1(std::make_shared<Silu>(), {x}); }
Tensor swiglu(const Tensor& h) { return run1(std::make_shared<SwiGLU>(), {h}); }
Tensor rope(const Tensor& x, double theta, int64_t rotated_heads, int64_t pos0) {
  const int64_t heads = rotated_heads >= 0 ? rotated_heads : x.dim() == 4 ? x.size(2) : 0;
  return run1(std::make_shared<Rope>(theta, heads, pos0, /*inverse=*/false), {x});
}

void add_(const Tensor& a, const Tensor& b) {
  check_same_shape("add_", a, b);
  check_floating("add_", a);
  check_floating("add_", b);
  if (!a.is_contiguous()) throw std::invalid_argument("add_: destination must be contiguous");
  dispatch(std::make_shared<AddInPlace>(), {a, b});
}

void assign_(const Tensor& dst, const Tensor& src) {
  if (!dst.is_contiguous()) throw std::invalid_argument("assign_: destination must be contiguous");
  dispatch(std::make_shared<AssignInPlace>(), {dst, src});
}

// ---- reductions ----

Tensor sum(const Tensor& x, int64_t dim, bool keepdim) {
  dim = normalize_dim("sum", dim, x.dim());
  return run1(std::make_shared<Sum>(dim, keepdim), {x});
}
Tensor mean(const Tensor& x, int64_t dim, bool keepdim) {
  dim = normalize_dim("mean", dim, x.dim());
  return scale(sum(x, dim, keepdim), 1.0f / static_cast<float>(x.shape()[dim]));
}
Tensor sum(const Tensor& x) { return reshape(sum(reshape(x, {-1}), 0), {}); }
Tensor mean(const Tensor& x) { return scale(sum(x), 1.0f / static_cast<float>(x.numel())); }

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  Tensor t = x;
  const int64_t lead = t.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0)
    throw std::invalid_argument(
        fmt::format("sum_to: cannot reduce {} to {}", shape_str(x.shape()), shape_str(shape)));
  if (lead > 0) {
    Shape rest(t.shape().begin() + lead, t.shape().end());
    t = sum(reshape(t,
                    [&] {
                      Shape s{-1};
                      s.insert(s.end(), rest.begin(), rest.end());
                      return s;
                    }()),
            0);
  }
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] == 1 && t.shape()[i] != 1) t = sum(t, static_cast<int64_t>(i), true);
  if (t.shape() != shape)
    throw std::invalid_argument(
        fmt::format("sum_to: cannot reduce {} to {}", shape_str(x.shape()), shape_str(shape)));
  return t;
}

// ---- linear algebra ----

Tensor matmul(const Tensor& a, const Tensor& b) { return run1(std::make_shared<Matmul>(), {a, b}); }

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  if (b.defined()) return run1(std::make_shared<Linear>(), {x, w, b});
  return run1(std::make_shared<Linear>(), {x, w});
}

// ---- normalisation, softmax, losses ----

Tensor softmax(const Tensor& x, float scale_factor, bool causal) {
  return run1(std::make_shared<Softmax>(scale_factor, causal), {x});
}
Tensor softmax_backward(const Tensor& y, const Tensor& grad, float scale_factor) {
  return run1(std::make_shared<SoftmaxBackward>(scale_factor), {y, grad});
}

LayerNormOut layer_norm_with_stats(const Tensor& x, const Tensor& w, const Tensor& b, float eps) {
  std::vector<Tensor> out = dispatch(std::make_shared<LayerNorm>(eps), {x, w, b});
  return {out[0], out[1], out[2]};
}
Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps) {
  return layer_norm_with_stats(x, w, b, eps).y;
}

Tensor rms_norm(const Tensor& x, const Tensor& w, float eps) {
  return run1(std::make_shared<RMSNorm>(eps), {x, w});
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  return run1(std::make_shared<Embedding>(), {weight, indices});
}

Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int32_t ignore_index) {
  return run1(std::make_shared<CrossEntropy>(ignore_index), {logits, targets});
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal) {
  const float s = 1.0f / std::sqrt(static_cast<float>(q.shape().back()));
  Tensor y = dispatch(std::make_shared<Attention>(s, causal), {q, k, v})[0];  // (B, T, H, d)
  return transpose(y, 1, 2);                                                  // (B, H, T, d)
}

Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const float s = 1.0f / std::sqrt(static_cast<float>(q.shape().back()));
  Tensor y = dispatch(std::make_shared<FlashAttention>(s, causal), {q, k, v})[0];  // (B, T, H, d)
  return transpose(y, 1, 2);                                                       // (B, H, T, d)
}

Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const float s = 1.0f / std::sqrt(static_cast<float>(q.shape().back()));
  Tensor scores = matmul(q, transpose(k, -2, -1));  // (B, H, T, T)
  return matmul(softmax(scores, s, causal), v);     // (B, H, T, d)
}

// ---- in-place updates ----
void advance_step_(const Tensor& count, const Tensor& skip) {
  dispatch(std::make_shared<AdvanceStep>(), {count, skip});
}
Tensor adamw_hyper(const Tensor& count, const Tensor& lr, float beta1, float beta2) {
  return dispatch(std::make_shared<AdamWHyper>(beta1, beta2), {count, lr})[0];
}
void adamw_update_(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                   const Tensor& hyper, const Tensor& grad_scale, const Tensor& skip, float beta1,
                   float beta2, float eps, float weight_decay) {
  dispatch(std::make_shared<AdamWUpdate>(beta1, beta2, eps, weight_decay),
           {p, g, m, v, hyper, grad_scale, skip});
}
void sgd_update_(const Tensor& p, const Tensor& g, const Tensor& buf, const Tensor& count,
                 const Tensor& lr, const Tensor& grad_scale, const Tensor& skip, float momentum,
                 float dampening, float weight_decay, bool nesterov) {
  dispatch(std::make_shared<SgdUpdate>(momentum, dampening, weight_decay, nesterov),
           {p, g, buf, count, lr, grad_scale, skip});
}
Tensor global_norm(const std::vector<Tensor>& tensors) {
  return dispatch(std::make_shared<GradNorm>(), tensors)[0];
}
Tensor sum_squares_bits(const Tensor& x) {
  return dispatch(std::make_shared<SumSquaresBits>(), {x})[0];
}
Tensor norm_of_partial_sums(const Tensor& bits) {
  return dispatch(std::make_shared<NormOfPartialSums>(), {bits})[0];
}
Tensor clip_factor(const Tensor& norm, float max_norm) {
  return dispatch(std::make_shared<ClipCoefficient>(max_norm), {norm})[0];
}
void scale_(const Tensor& x, float c) { dispatch(std::make_shared<ScaleInPlace>(c), {x}); }
void unscale_and_check_(const Tensor& g, const Tensor& scale, const Tensor& found_inf) {
  dispatch(std::make_shared<UnscaleAndCheck>(), {g, scale, found_inf});
}
void scaler_update_(const Tensor& scale, const Tensor& tracker, const Tensor& found_inf,
                    float backoff, float growth, int64_t growth_interval) {
  dispatch(std::make_shared<ScalerUpdate>(backoff, growth, growth_interval),
           {scale, tracker, found_inf});
}

}  // namespace kuai
