// Shape inference and vector-Jacobian products of the primitives (evaluation is per backend).
#include "kuai/core/primitives.h"

#include <fmt/format.h>

#include <stdexcept>

#include "kuai/core/dispatch.h"
#include "kuai/core/ops.h"
#include "kuai/core/shape_util.h"

namespace kuai {
namespace {

[[noreturn]] void not_twice(std::string_view op) {
  throw std::logic_error(fmt::format("{} is not differentiable (no double backward)", op));
}

std::vector<Tensor> one(Tensor t) { return {std::move(t)}; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Views

std::vector<TensorSpec> ViewPrimitive::infer(std::span<const Tensor>) const { return {}; }
void ViewPrimitive::eval_cpu(std::span<const Tensor>, std::span<Tensor>) const {}

std::vector<Tensor> View::make_views(std::span<const Tensor> in) const {
  return one(Tensor::view_of(in[0], shape_, strides_, in[0].offset()));
}
std::vector<Tensor> View::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                              std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(reshape(g[0], in[0].shape()));
}

std::vector<Tensor> AsStrided::make_views(std::span<const Tensor> in) const {
  return one(Tensor::view_of(in[0], shape_, strides_, in[0].offset() + offset_));
}
std::vector<Tensor> AsStrided::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                   std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("as_strided (a captured view) has no gradient");
}

std::vector<Tensor> Permute::make_views(std::span<const Tensor> in) const {
  const Tensor& x = in[0];
  Shape shape(dims_.size()), strides(dims_.size());
  for (size_t i = 0; i < dims_.size(); ++i) {
    shape[i] = x.shape()[dims_[i]];
    strides[i] = x.strides()[dims_[i]];
  }
  return one(Tensor::view_of(x, std::move(shape), std::move(strides), x.offset()));
}
std::vector<Tensor> Permute::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                 std::span<const Tensor> g, const std::vector<bool>&) const {
  std::vector<int64_t> inverse(dims_.size());
  for (size_t i = 0; i < dims_.size(); ++i) inverse[dims_[i]] = static_cast<int64_t>(i);
  return one(permute(g[0], inverse));
}

std::vector<Tensor> Expand::make_views(std::span<const Tensor> in) const {
  const Tensor& x = in[0];
  const int64_t lead = static_cast<int64_t>(shape_.size()) - x.dim();
  Shape strides(shape_.size(), 0);
  for (int64_t i = 0; i < x.dim(); ++i)
    strides[lead + i] = x.shape()[i] == shape_[lead + i] ? x.strides()[i] : 0;
  return one(Tensor::view_of(x, shape_, std::move(strides), x.offset()));
}
std::vector<Tensor> Expand::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(sum_to(g[0], in[0].shape()));
}

namespace {
// When the parts are views of one storage with equal strides that sit one after another along
// `dim` (as when a primitive wrote the gradients of several chunks into one buffer), the view
// spanning all of them; otherwise an undefined tensor. Their sizes along `dim` may differ.
Tensor join_adjacent_views(std::span<const Tensor> parts, int64_t dim) {
  if (parts.empty()) return {};
  const Tensor& first = parts[0];
  if (!first.defined() || !first.has_storage()) return {};
  int64_t next = first.offset();
  Shape shape = first.shape();
  shape[dim] = 0;
  auto same_but_dim = [&](const Shape& a, const Shape& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (static_cast<int64_t>(i) != dim && a[i] != b[i]) return false;
    return true;
  };
  for (const Tensor& p : parts) {
    if (!p.defined() || !p.has_storage() || p.storage() != first.storage() ||
        !same_but_dim(p.shape(), first.shape()) || p.strides() != first.strides() ||
        p.offset() != next)
      return {};
    next += p.shape()[dim] * p.strides()[dim];
    shape[dim] += p.shape()[dim];
  }
  return Tensor::view_of(first, std::move(shape), first.strides(), first.offset());
}
}  // namespace

std::vector<Tensor> Chunk::make_views(std::span<const Tensor> in) const {
  const Tensor& x = in[0];
  const int64_t part = x.shape()[dim_] / chunks_;
  std::vector<Tensor> out;
  Shape shape = x.shape();
  shape[dim_] = part;
  for (int64_t c = 0; c < chunks_; ++c)
    out.push_back(
        Tensor::view_of(x, shape, x.strides(), x.offset() + c * part * x.strides()[dim_]));
  return out;
}
namespace {
// The gradient of a tensor cut into consecutive parts along dim: the view over the parts'
// gradients when a primitive wrote them side by side, else their concatenation (zeros for a part
// that got none).
Tensor join_part_gradients(std::span<const Tensor> g, std::span<const Tensor> out, int64_t dim) {
  if (Tensor joined = join_adjacent_views(g, dim); joined.defined()) return joined;
  std::vector<Tensor> parts;
  for (size_t c = 0; c < g.size(); ++c)
    parts.push_back(g[c].defined() ? g[c] : zeros(out[c].shape(), out[c].dtype(), out[c].device()));
  return cat(parts, dim);
}
}  // namespace

std::vector<Tensor> Chunk::vjp(std::span<const Tensor>, std::span<const Tensor> out,
                               std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(join_part_gradients(g, out, dim_));
}

std::vector<Tensor> Split::make_views(std::span<const Tensor> in) const {
  const Tensor& x = in[0];
  std::vector<Tensor> out;
  Shape shape = x.shape();
  int64_t at = 0;
  for (int64_t n : sizes_) {
    shape[dim_] = n;
    out.push_back(Tensor::view_of(x, shape, x.strides(), x.offset() + at * x.strides()[dim_]));
    at += n;
  }
  return out;
}
std::vector<Tensor> Split::vjp(std::span<const Tensor>, std::span<const Tensor> out,
                               std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(join_part_gradients(g, out, dim_));
}

std::vector<Tensor> Narrow::make_views(std::span<const Tensor> in) const {
  const Tensor& x = in[0];
  Shape shape = x.shape();
  shape[dim_] = length_;
  return one(
      Tensor::view_of(x, std::move(shape), x.strides(), x.offset() + start_ * x.strides()[dim_]));
}
std::vector<Tensor> Narrow::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                std::span<const Tensor> g, const std::vector<bool>&) const {
  return dispatch(std::make_shared<NarrowBackward>(in[0].shape(), dim_, start_), {g[0]});
}

// ---------------------------------------------------------------------------------------------
// Copies

std::vector<TensorSpec> Copy::infer(std::span<const Tensor> in) const {
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> Copy::vjp(std::span<const Tensor>, std::span<const Tensor>,
                              std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(g[0]);
}

std::vector<TensorSpec> Cast::infer(std::span<const Tensor> in) const {
  return {{in[0].shape(), to_}};
}
std::vector<Tensor> Cast::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                              std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(cast(g[0], in[0].dtype()));
}

std::vector<TensorSpec> Concat::infer(std::span<const Tensor> in) const {
  if (in.empty()) throw std::invalid_argument("cat: no tensors");
  Shape shape = in[0].shape();
  const int64_t d = dim_;
  if (d < 0 || d >= in[0].dim())
    throw std::invalid_argument(fmt::format("cat: dim {} out of range for {}", d, in[0].str()));
  for (size_t i = 1; i < in.size(); ++i) {
    bool ok = in[i].dim() == in[0].dim() && in[i].dtype() == in[0].dtype();
    for (int64_t k = 0; ok && k < in[0].dim(); ++k)
      ok = k == d || in[i].shape()[k] == in[0].shape()[k];
    if (!ok)
      throw std::invalid_argument(
          fmt::format("cat: {} and {} do not match outside dim {}", in[0].str(), in[i].str(), d));
    shape[d] += in[i].shape()[d];
  }
  return {{shape, in[0].dtype()}};
}
std::vector<Tensor> Concat::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                std::span<const Tensor> g, const std::vector<bool>& needs) const {
  std::vector<Tensor> out(in.size());
  int64_t start = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const int64_t len = in[i].shape()[dim_];
    if (needs[i]) out[i] = narrow(g[0], dim_, start, len);
    start += len;
  }
  return out;
}

std::vector<TensorSpec> NarrowBackward::infer(std::span<const Tensor> in) const {
  return {{shape_, in[0].dtype()}};
}
std::vector<Tensor> NarrowBackward::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                        std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(narrow(g[0], dim_, start_, in[0].shape()[dim_]));
}

// ---------------------------------------------------------------------------------------------
// Elementwise

std::string_view Binary::name() const {
  switch (op_) {
    case BinaryOp::kAdd:
      return "add";
    case BinaryOp::kSub:
      return "sub";
    case BinaryOp::kMul:
      return "mul";
    case BinaryOp::kDiv:
      return "div";
  }
  return "binary";
}

std::vector<TensorSpec> Binary::infer(std::span<const Tensor> in) const {
  check_floating(name(), in[0]);
  check_floating(name(), in[1]);
  return {{broadcast_shapes(name(), in[0].shape(), in[1].shape()),
           promote_types(in[0].dtype(), in[1].dtype())}};
}

std::vector<Tensor> Binary::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                std::span<const Tensor> g, const std::vector<bool>& needs) const {
  const Tensor& a = in[0];
  const Tensor& b = in[1];
  const Tensor& gy = g[0];
  std::vector<Tensor> out(2);
  switch (op_) {
    case BinaryOp::kAdd:
      if (needs[0]) out[0] = sum_to(gy, a.shape());
      if (needs[1]) out[1] = sum_to(gy, b.shape());
      break;
    case BinaryOp::kSub:
      if (needs[0]) out[0] = sum_to(gy, a.shape());
      if (needs[1]) out[1] = sum_to(scale(gy, -1.0f), b.shape());
      break;
    case BinaryOp::kMul:
      if (needs[0]) out[0] = sum_to(mul(gy, b), a.shape());
      if (needs[1]) out[1] = sum_to(mul(gy, a), b.shape());
      break;
    case BinaryOp::kDiv:
      if (needs[0]) out[0] = sum_to(div(gy, b), a.shape());
      if (needs[1]) out[1] = sum_to(scale(div(mul(gy, a), mul(b, b)), -1.0f), b.shape());
      break;
  }
  return out;
}

std::vector<TensorSpec> Scale::infer(std::span<const Tensor> in) const {
  check_floating(name(), in[0]);
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> Scale::vjp(std::span<const Tensor>, std::span<const Tensor>,
                               std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(scale(g[0], s_));
}

std::vector<TensorSpec> Gelu::infer(std::span<const Tensor> in) const {
  check_floating(name(), in[0]);
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> Gelu::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                              std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(gelu_backward(in[0], g[0]));
}

std::vector<TensorSpec> Silu::infer(std::span<const Tensor> in) const {
  check_floating(name(), in[0]);
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> Silu::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                              std::span<const Tensor> g, const std::vector<bool>&) const {
  const Tensor gy = g[0].dtype() == in[0].dtype() ? g[0] : cast(g[0], in[0].dtype());
  return dispatch(std::make_shared<SiluBackward>(), {in[0], gy});
}
std::vector<TensorSpec> SiluBackward::infer(std::span<const Tensor> in) const {
  check_same_shape(name(), in[0], in[1]);
  check_same_floating(name(), in);
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> SiluBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                      std::span<const Tensor>, const std::vector<bool>&) const {
  not_twice(name());
}

std::vector<TensorSpec> SwiGLU::infer(std::span<const Tensor> in) const {
  const Tensor& h = in[0];
  check_floating(name(), h);
  if (h.dim() < 1 || h.shape().back() % 2 != 0)
    throw std::invalid_argument(
        fmt::format("swiglu: the last dimension of {} must hold gate and up halves", h.str()));
  Shape s = h.shape();
  s.back() /= 2;
  return {{s, h.dtype()}};
}
std::vector<Tensor> SwiGLU::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                std::span<const Tensor> g, const std::vector<bool>&) const {
  const Tensor gy = g[0].dtype() == in[0].dtype() ? g[0] : cast(g[0], in[0].dtype());
  return dispatch(std::make_shared<SwiGLUBackward>(), {in[0], gy});
}
std::vector<TensorSpec> SwiGLUBackward::infer(std::span<const Tensor> in) const {
  check_same_floating(name(), in);
  Shape half = in[0].shape();
  if (!half.empty()) half.back() /= 2;
  if (in[1].shape() != half)
    throw std::invalid_argument(
        fmt::format("swiglu_backward: dy {} does not fit h {}", in[1].str(), in[0].str()));
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> SwiGLUBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                        std::span<const Tensor>, const std::vector<bool>&) const {
  not_twice(name());
}

std::vector<TensorSpec> Rope::infer(std::span<const Tensor> in) const {
  const Tensor& x = in[0];
  check_floating(name(), x);
  if (x.dim() != 4 || x.size(3) % 2 != 0 || rotated_heads_ < 0 || rotated_heads_ > x.size(2) ||
      pos0_ < 0)
    throw std::invalid_argument(fmt::format(
        "rope: x must be (B, T, heads, d) with d even and rotated heads ({}) at most heads, got {}",
        rotated_heads_, x.str()));
  return {{x.shape(), x.dtype()}};
}
std::vector<Tensor> Rope::vjp(std::span<const Tensor>, std::span<const Tensor>,
                              std::span<const Tensor> g, const std::vector<bool>&) const {
  return dispatch(std::make_shared<Rope>(theta_, rotated_heads_, pos0_, !inverse_), {g[0]});
}

std::vector<TensorSpec> GeluBackward::infer(std::span<const Tensor> in) const {
  check_same_shape(name(), in[0], in[1]);
  check_same_floating(name(), in);
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> GeluBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                      std::span<const Tensor>, const std::vector<bool>&) const {
  not_twice(name());
}

// ---------------------------------------------------------------------------------------------
// Reductions

std::vector<TensorSpec> Sum::infer(std::span<const Tensor> in) const {
  check_floating(name(), in[0]);
  Shape s = in[0].shape();
  if (dim_ < 0 || dim_ >= in[0].dim())
    throw std::invalid_argument(fmt::format("sum: dim {} out of range for {}", dim_, in[0].str()));
  if (keepdim_)
    s[dim_] = 1;
  else
    s.erase(s.begin() + dim_);
  return {{s, in[0].dtype()}};
}
std::vector<Tensor> Sum::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                             std::span<const Tensor> g, const std::vector<bool>&) const {
  Shape kept = in[0].shape();
  kept[dim_] = 1;
  return one(expand(reshape(g[0], kept), in[0].shape()));
}

// ---------------------------------------------------------------------------------------------
// Linear algebra

std::vector<TensorSpec> Matmul::infer(std::span<const Tensor> in) const {
  const Tensor& a = in[0];
  const Tensor& b = in[1];
  check_same_floating(name(), in);
  if (a.dim() < 2 || b.dim() < 2 || a.shape().back() != b.shape()[b.dim() - 2])
    throw std::invalid_argument(fmt::format("matmul: cannot multiply {} by {}",
                                            shape_str(a.shape()), shape_str(b.shape())));
  Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
  if (!ba.empty() && !bb.empty() && ba != bb)
    throw std::invalid_argument(fmt::format("matmul: batch dims of {} and {} differ",
                                            shape_str(a.shape()), shape_str(b.shape())));
  Shape out = ba.empty() ? bb : ba;
  out.push_back(a.shape()[a.dim() - 2]);
  out.push_back(b.shape().back());
  return {{out, a.dtype()}};
}

std::vector<Tensor> Matmul::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                std::span<const Tensor> g, const std::vector<bool>& needs) const {
  const Tensor& a = in[0];
  const Tensor& b = in[1];
  const Tensor& gy = g[0];
  std::vector<Tensor> out(2);
  if (needs[0]) {
    if (a.dim() == 2 && b.dim() > 2) {  // a was broadcast over b's batch
      Tensor ga = matmul(gy, transpose(b, -1, -2));
      out[0] = sum_to(ga, a.shape());
    } else {
      out[0] = matmul(gy, transpose(b, -1, -2));
    }
  }
  if (needs[1]) {
    if (b.dim() == 2 && a.dim() > 2) {  // fold a's batch into rows: (K, R) @ (R, N)
      const int64_t K = a.shape().back(), N = gy.shape().back();
      out[1] = matmul(transpose(reshape(a, {-1, K}), 0, 1), reshape(gy, {-1, N}));
    } else if (a.dim() == 2 && b.dim() > 2) {
      out[1] = matmul(transpose(a, -1, -2), gy);
    } else {
      out[1] = matmul(transpose(a, -1, -2), gy);
    }
  }
  return out;
}

std::vector<TensorSpec> Linear::infer(std::span<const Tensor> in) const {
  const Tensor& x = in[0];
  const Tensor& w = in[1];
  check_same_floating(name(), in);
  if (x.dim() < 1 || w.dim() != 2 || x.shape().back() != w.shape()[1])
    throw std::invalid_argument(fmt::format("linear: input {} does not fit weight {}",
                                            shape_str(x.shape()), shape_str(w.shape())));
  if (in.size() == 3 && (in[2].dim() != 1 || in[2].shape()[0] != w.shape()[0]))
    throw std::invalid_argument(fmt::format("linear: bias {} does not fit weight {}",
                                            shape_str(in[2].shape()), shape_str(w.shape())));
  Shape out = x.shape();
  out.back() = w.shape()[0];
  return {{out, x.dtype()}};
}

std::vector<Tensor> Linear::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                std::span<const Tensor> g, const std::vector<bool>& needs) const {
  const Tensor& x = in[0];
  const Tensor& w = in[1];
  const int64_t N = w.shape()[0], K = w.shape()[1];
  Tensor g2 = reshape(g[0], {-1, N});  // (R, N)
  std::vector<Tensor> out(in.size());
  if (needs[0]) out[0] = reshape(matmul(g2, w), x.shape());                 // (R, K)
  if (needs[1]) out[1] = matmul(transpose(g2, 0, 1), reshape(x, {-1, K}));  // (N, K)
  if (in.size() == 3 && needs[2]) out[2] = sum(g2, 0);                      // (N)
  return out;
}

// ---------------------------------------------------------------------------------------------
// Costs (primitive.h): products count 2 FLOPs per multiply-add.

Cost Primitive::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c;
  if (is_view()) return c;
  for (const Tensor& t : in) c.bytes_read += t.nbytes();
  for (const Tensor& t : out) c.bytes_written += t.nbytes();
  return c;
}

Cost Matmul::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c = Primitive::cost(in, out);
  c.flops = 2.0 * static_cast<double>(out[0].numel()) * static_cast<double>(in[0].shape().back());
  return c;
}

Cost Linear::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c = Primitive::cost(in, out);  // the bias add is counted as traffic, not FLOPs
  c.flops = 2.0 * static_cast<double>(out[0].numel()) * static_cast<double>(in[1].shape()[1]);
  return c;
}

namespace {
// Query-key pairs attention multiplies: every pair, or under the causal mask the ones at or
// before each query's position (query i of tq sits at tk - tq + i).
double attention_pairs(const Tensor& q, const Tensor& k, bool causal) {
  const double tq = static_cast<double>(q.size(2)), tk = static_cast<double>(k.size(2));
  const double per_head = causal ? tq * (tk - tq) + tq * (tq + 1) / 2 : tq * tk;
  return static_cast<double>(q.size(0)) * static_cast<double>(q.size(1)) * per_head;
}
}  // namespace

// Forward: S = Q K^T and Y = P V, 2 products of d per pair. Backward: dV = P^T dY, dP = dY V^T,
// dQ = dS K, dK = dS^T Q (4 products); flash recomputes S as well (5).
Cost Attention::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c = Primitive::cost(in, out);
  c.flops = 4.0 * attention_pairs(in[0], in[1], causal_) * static_cast<double>(in[0].size(3));
  return c;
}
Cost FlashAttention::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c = Primitive::cost(in, out);
  c.flops = 4.0 * attention_pairs(in[0], in[1], causal_) * static_cast<double>(in[0].size(3));
  return c;
}
Cost AttentionBackward::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c = Primitive::cost(in, out);
  c.flops = 8.0 * attention_pairs(in[0], in[1], causal_) * static_cast<double>(in[0].size(3));
  return c;
}
Cost FlashAttentionBackward::cost(std::span<const Tensor> in, std::span<const Tensor> out) const {
  Cost c = Primitive::cost(in, out);
  c.flops = 10.0 * attention_pairs(in[0], in[1], causal_) * static_cast<double>(in[0].size(3));
  return c;
}

// ---------------------------------------------------------------------------------------------
// Normalisation, softmax, losses

std::vector<TensorSpec> Softmax::infer(std::span<const Tensor> in) const {
  check_float32(name(), in[0]);
  if (in[0].dim() < 1) throw std::invalid_argument("softmax: needs at least one dimension");
  if (causal_ && (in[0].dim() < 2 || in[0].shape().back() != in[0].shape()[in[0].dim() - 2]))
    throw std::invalid_argument("softmax: causal needs square (..., T, T) scores, got " +
                                shape_str(in[0].shape()));
  return {{in[0].shape(), DType::kF32}};
}
std::vector<Tensor> Softmax::vjp(std::span<const Tensor>, std::span<const Tensor> out,
                                 std::span<const Tensor> g, const std::vector<bool>&) const {
  return one(softmax_backward(out[0], g[0], scale_));
}

std::vector<TensorSpec> SoftmaxBackward::infer(std::span<const Tensor> in) const {
  check_same_shape(name(), in[0], in[1]);
  return {{in[0].shape(), DType::kF32}};
}
std::vector<Tensor> SoftmaxBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                         std::span<const Tensor>, const std::vector<bool>&) const {
  not_twice(name());
}

std::vector<TensorSpec> AddLayerNorm::infer(std::span<const Tensor> in) const {
  if (in.size() != 4) throw std::invalid_argument("add_layer_norm: takes (a, b, weight, bias)");
  for (size_t i : {0, 2, 3}) check_float32(name(), in[i]);
  check_floating(name(), in[1]);  // fp32, or an autocast branch widened into the fp32 sum
  if (in[0].shape() != in[1].shape())
    throw std::invalid_argument(fmt::format("add_layer_norm: a {} and b {} differ",
                                            shape_str(in[0].shape()), shape_str(in[1].shape())));
  std::vector<TensorSpec> ln = LayerNorm(eps_).infer(std::vector<Tensor>{in[0], in[2], in[3]});
  ln.insert(ln.begin(), TensorSpec{in[0].shape(), DType::kF32});
  return ln;
}
std::vector<Tensor> AddLayerNorm::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                      std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("add_layer_norm is made by graph fusion and has no vjp");
}

std::vector<TensorSpec> LayerNorm::infer(std::span<const Tensor> in) const {
  for (const Tensor& t : in) check_float32(name(), t);
  const Tensor& x = in[0];
  if (x.dim() < 1) throw std::invalid_argument("layer_norm: needs at least one dimension");
  const int64_t C = x.shape().back();
  for (size_t i = 1; i < 3; ++i)
    if (in[i].dim() != 1 || in[i].shape()[0] != C)
      throw std::invalid_argument(fmt::format("layer_norm: {} {} does not fit input {}",
                                              i == 1 ? "weight" : "bias", shape_str(in[i].shape()),
                                              shape_str(x.shape())));
  const int64_t N = C == 0 ? 0 : x.numel() / C;
  return {{x.shape(), DType::kF32}, {{N}, DType::kF32}, {{N}, DType::kF32}};
}
std::vector<Tensor> LayerNorm::vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                                   std::span<const Tensor> g,
                                   const std::vector<bool>& needs) const {
  if (!g[0].defined()) return std::vector<Tensor>(3);
  return dispatch(std::make_shared<LayerNormBackward>(), {in[0], in[1], out[1], out[2], g[0]});
}

std::vector<TensorSpec> FusedElementwise::infer(std::span<const Tensor> in) const {
  if (in.empty() || steps_.empty())
    throw std::invalid_argument("fused_elementwise: takes at least one input and one step");
  for (const Tensor& t : in) {
    check_float32(name(), t);
    check_same_shape(name(), in[0], t);
  }
  for (const Step& st : steps_)
    for (int a : st.args)
      if (a >= static_cast<int>(in.size()))
        throw std::invalid_argument(
            fmt::format("fused_elementwise: a step reads input {} of {}", a, in.size()));
  return {{in[0].shape(), DType::kF32}};
}
std::vector<Tensor> FusedElementwise::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                          std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("fused_elementwise is made by graph fusion and has no vjp");
}
int64_t FusedElementwise::scratch_bytes(int threads) const {
  return static_cast<int64_t>(threads) * static_cast<int64_t>(steps_.size() - 1) * kBlock *
         static_cast<int64_t>(sizeof(float));
}

std::vector<TensorSpec> LayerNormBackwardAdd::infer(std::span<const Tensor> in) const {
  if (in.size() != 6)
    throw std::invalid_argument("layer_norm_backward_add_: takes (x, w, mean, rstd, dy, acc)");
  for (const Tensor& t : in) check_float32(name(), t);
  check_same_shape(name(), in[0], in[5]);
  std::vector<TensorSpec> s = LayerNormBackward().infer(in.first(5));
  return {s[1], s[2]};
}
std::vector<Tensor> LayerNormBackwardAdd::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                              std::span<const Tensor>,
                                              const std::vector<bool>&) const {
  throw std::logic_error("layer_norm_backward_add_ is made by graph fusion and has no vjp");
}

std::vector<TensorSpec> GeluBackwardSum::infer(std::span<const Tensor> in) const {
  if (in.size() != 2) throw std::invalid_argument("gelu_backward_sum: takes (x, dy)");
  for (const Tensor& t : in) check_float32(name(), t);
  check_same_shape(name(), in[0], in[1]);
  int64_t n = 1;
  for (int64_t d : db_shape_) n *= d;
  if (in[0].dim() < 1 || n != in[0].shape().back())
    throw std::invalid_argument(
        fmt::format("gelu_backward_sum: db {} does not fit {}", shape_str(db_shape_), in[0].str()));
  return {{in[0].shape(), DType::kF32}, {db_shape_, DType::kF32}};
}
std::vector<Tensor> GeluBackwardSum::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                         std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("gelu_backward_sum is made by graph fusion and has no vjp");
}

std::vector<TensorSpec> CrossEntropyWithGrad::infer(std::span<const Tensor> in) const {
  if (in.size() != 3)
    throw std::invalid_argument("cross_entropy_with_grad: takes (logits, targets, dloss)");
  std::vector<TensorSpec> s = CrossEntropy(ignore_).infer(in.first(2));
  if (in[2].numel() != 1 || in[2].dtype() != DType::kF32)
    throw std::invalid_argument(
        fmt::format("cross_entropy_with_grad: dloss must be one float32, got {}", in[2].str()));
  s.push_back({in[0].shape(), in[0].dtype()});
  return s;
}
std::vector<Tensor> CrossEntropyWithGrad::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                              std::span<const Tensor>,
                                              const std::vector<bool>&) const {
  throw std::logic_error("cross_entropy_with_grad is made by graph fusion and has no vjp");
}

std::vector<TensorSpec> RMSNorm::infer(std::span<const Tensor> in) const {
  for (const Tensor& t : in) check_float32(name(), t);
  const Tensor& x = in[0];
  if (x.dim() < 1) throw std::invalid_argument("rms_norm: needs at least one dimension");
  const int64_t C = x.shape().back();
  if (in[1].dim() != 1 || in[1].shape()[0] != C)
    throw std::invalid_argument(fmt::format("rms_norm: weight {} does not fit input {}",
                                            shape_str(in[1].shape()), shape_str(x.shape())));
  const int64_t N = C == 0 ? 0 : x.numel() / C;
  return {{x.shape(), DType::kF32}, {{N}, DType::kF32}};
}
std::vector<Tensor> RMSNorm::vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                                 std::span<const Tensor> g, const std::vector<bool>&) const {
  if (!g[0].defined()) return std::vector<Tensor>(2);
  const Tensor gy = g[0].dtype() == DType::kF32 ? g[0] : cast(g[0], DType::kF32);
  return dispatch(std::make_shared<RMSNormBackward>(), {in[0], in[1], out[1], gy});
}
std::vector<TensorSpec> RMSNormBackward::infer(std::span<const Tensor> in) const {
  for (const Tensor& t : in) check_float32(name(), t);
  check_same_shape(name(), in[0], in[3]);
  return {{in[0].shape(), DType::kF32}, {in[1].shape(), DType::kF32}};
}
std::vector<Tensor> RMSNormBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                         std::span<const Tensor>, const std::vector<bool>&) const {
  not_twice(name());
}

std::vector<TensorSpec> LayerNormBackward::infer(std::span<const Tensor> in) const {
  check_same_shape(name(), in[0], in[4]);
  return {{in[0].shape(), DType::kF32}, {in[1].shape(), DType::kF32}, {in[1].shape(), DType::kF32}};
}
std::vector<Tensor> LayerNormBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                           std::span<const Tensor>,
                                           const std::vector<bool>&) const {
  not_twice(name());
}

std::vector<TensorSpec> Embedding::infer(std::span<const Tensor> in) const {
  const Tensor& w = in[0];
  const Tensor& idx = in[1];
  check_float32(name(), w);
  if (w.dim() != 2) throw std::invalid_argument("embedding: weight must be 2-D, got " + w.str());
  if (idx.dtype() != DType::kI32)
    throw std::invalid_argument("embedding: indices must be int32, got " + idx.str());
  Shape out = idx.shape();
  out.push_back(w.shape()[1]);
  return {{out, DType::kF32}};
}
std::vector<Tensor> Embedding::vjp(std::span<const Tensor> in, std::span<const Tensor>,
                                   std::span<const Tensor> g, const std::vector<bool>&) const {
  return {dispatch(std::make_shared<EmbeddingBackward>(in[0].shape()[0]), {in[1], g[0]})[0],
          Tensor()};
}

std::vector<TensorSpec> EmbeddingBackward::infer(std::span<const Tensor> in) const {
  const int64_t C = in[1].shape().back();
  if (in[1].numel() != in[0].numel() * C)
    throw std::invalid_argument(fmt::format("embedding_backward: grad {} does not fit indices {}",
                                            shape_str(in[1].shape()), shape_str(in[0].shape())));
  return {{{num_, C}, DType::kF32}};
}
std::vector<Tensor> EmbeddingBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                           std::span<const Tensor>,
                                           const std::vector<bool>&) const {
  not_twice(name());
}

std::vector<TensorSpec> CrossEntropy::infer(std::span<const Tensor> in) const {
  const Tensor& logits = in[0];
  const Tensor& targets = in[1];
  check_floating(name(), logits);
  if (logits.dim() != 2 || targets.dim() != 1 || targets.shape()[0] != logits.shape()[0] ||
      targets.dtype() != DType::kI32)
    throw std::invalid_argument(fmt::format(
        "cross_entropy: expected logits (N, V) floating and targets (N) int32, got {} and {}",
        logits.str(), targets.str()));
  const int64_t N = logits.shape()[0];
  return {{{}, DType::kF32}, {{N}, DType::kF32}, {{}, DType::kF32}};
}
std::vector<Tensor> CrossEntropy::vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                                      std::span<const Tensor> g, const std::vector<bool>&) const {
  if (!g[0].defined()) return std::vector<Tensor>(2);
  return {dispatch(std::make_shared<CrossEntropyBackward>(ignore_),
                   {in[0], in[1], out[1], out[2], g[0]})[0],
          Tensor()};
}

std::vector<TensorSpec> CrossEntropyBackward::infer(std::span<const Tensor> in) const {
  return {{in[0].shape(), in[0].dtype()}};
}
std::vector<Tensor> CrossEntropyBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                              std::span<const Tensor>,
                                              const std::vector<bool>&) const {
  not_twice(name());
}

// ---------------------------------------------------------------------------------------------
// Attention

namespace {

// The kernels read every operand in q's dtype: an output gradient of another dtype is cast.
Tensor like(const Tensor& g, const Tensor& q) {
  return g.dtype() == q.dtype() ? g : cast(g, q.dtype());
}

// The views of dq (B, H, T, d), dk and dv (B, Hkv, T, d) in an attention backward's (B, T, H + 2
// Hkv, d) output (with Hkv == H, the (B, T, 3, H, d) layout of a fused qkv projection).
std::vector<Tensor> qkv_grad_views(const Tensor& g, int64_t H, int64_t Hkv) {
  const Shape& s = g.shape();
  const Shape strides{g.strides()[0], g.strides()[2], g.strides()[1], g.strides()[3]};
  const int64_t at[3] = {0, H, H + Hkv}, heads[3] = {H, Hkv, Hkv};
  std::vector<Tensor> grads;
  for (int c = 0; c < 3; ++c)
    grads.push_back(Tensor::view_of(g, {s[0], heads[c], s[1], s[3]}, strides,
                                    g.offset() + at[c] * g.strides()[2]));
  return grads;
}

// q (B, H, tq, d), k and v (B, Hkv, tk, d) with Hkv dividing H (grouped-query attention: query
// head h reads key/value head h / (H / Hkv)); tk == tq unless `tk_may_differ`.
void check_attention_shapes(std::string_view op, const Tensor& q, const Tensor& k, const Tensor& v,
                            bool tk_may_differ, bool causal) {
  const bool ok = q.dim() == 4 && k.dim() == 4 && k.shape() == v.shape() &&
                  q.size(0) == k.size(0) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 &&
                  q.size(3) == k.size(3) && q.size(3) > 0 &&
                  (tk_may_differ ? (!causal || q.size(2) <= k.size(2)) : q.size(2) == k.size(2));
  if (!ok)
    throw std::invalid_argument(fmt::format(
        "{}: q must be (B, H, {}, d) and k, v (B, Hkv, {}, d) with Hkv dividing H{}, got {}, {}, "
        "{}",
        op, tk_may_differ ? "tq" : "T", tk_may_differ ? "tk" : "T",
        tk_may_differ && causal ? " and tq <= tk" : "", shape_str(q.shape()), shape_str(k.shape()),
        shape_str(v.shape())));
}

}  // namespace

std::vector<TensorSpec> Attention::infer(std::span<const Tensor> in) const {
  check_same_floating(name(), in);
  const Tensor& q = in[0];
  check_attention_shapes(name(), q, in[1], in[2], false, causal_);
  const int64_t B = q.shape()[0], H = q.shape()[1], T = q.shape()[2], d = q.shape()[3];
  return {{{B, T, H, d}, q.dtype()}, {{B, H, T, T}, q.dtype()}};
}

std::vector<Tensor> Attention::vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                                   std::span<const Tensor> g, const std::vector<bool>&) const {
  if (!g[0].defined()) return std::vector<Tensor>(3);
  std::vector<Tensor> d = dispatch(std::make_shared<AttentionBackward>(scale_, causal_),
                                   {in[0], in[1], in[2], out[1], like(g[0], in[0])});
  return qkv_grad_views(d[0], in[0].size(1), in[1].size(1));
}

std::vector<TensorSpec> AttentionBackward::infer(std::span<const Tensor> in) const {
  const Shape& s = in[4].shape();  // (B, T, H, d)
  return {{{s[0], s[1], s[2] + 2 * in[1].size(1), s[3]}, in[0].dtype()}};
}

std::vector<Tensor> AttentionBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                           std::span<const Tensor>,
                                           const std::vector<bool>&) const {
  not_twice(name());
}

// ---------------------------------------------------------------------------------------------
// FlashAttention

std::vector<TensorSpec> FlashAttention::infer(std::span<const Tensor> in) const {
  check_same_floating(name(), in);
  const Tensor& q = in[0];
  check_attention_shapes(name(), q, in[1], in[2], true, causal_);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3);
  return {{{B, T, H, d}, q.dtype()}, {{B, H, T}, DType::kF32}};
}

std::vector<Tensor> FlashAttention::vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                                        std::span<const Tensor> g, const std::vector<bool>&) const {
  if (!g[0].defined()) return std::vector<Tensor>(3);
  if (in[0].size(2) != in[1].size(2))
    throw std::invalid_argument(
        fmt::format("flash_attention: gradients need as many queries as keys, got tq {} and tk {}",
                    in[0].size(2), in[1].size(2)));
  std::vector<Tensor> d = dispatch(std::make_shared<FlashAttentionBackward>(scale_, causal_),
                                   {in[0], in[1], in[2], out[0], out[1], like(g[0], in[0])});
  return qkv_grad_views(d[0], in[0].size(1), in[1].size(1));
}

std::vector<TensorSpec> FlashAttentionBackward::infer(std::span<const Tensor> in) const {
  const Shape& s = in[5].shape();  // (B, T, H, d)
  return {{{s[0], s[1], s[2] + 2 * in[1].size(1), s[3]}, in[0].dtype()}};
}

std::vector<Tensor> FlashAttentionBackward::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                                std::span<const Tensor>,
                                                const std::vector<bool>&) const {
  not_twice(name());
}

// ---- creation ----

std::vector<TensorSpec> Fill::infer(std::span<const Tensor> in) const {
  if (!in.empty()) throw std::invalid_argument("fill: takes no inputs");
  return {{shape_, dtype_}};
}
std::vector<Tensor> Fill::vjp(std::span<const Tensor>, std::span<const Tensor>,
                              std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("fill has no inputs to differentiate");
}

std::vector<TensorSpec> Arange::infer(std::span<const Tensor> in) const {
  if (!in.empty()) throw std::invalid_argument("arange: takes no inputs");
  if (n_ < 0) throw std::invalid_argument(fmt::format("arange: negative length {}", n_));
  return {{{n_}, DType::kF32}};
}
std::vector<Tensor> Arange::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("arange has no inputs to differentiate");
}

std::vector<TensorSpec> RandomFill::infer(std::span<const Tensor> in) const {
  if (!in.empty()) throw std::invalid_argument("random: takes no inputs");
  for (int64_t d : shape_)
    if (d < 0) throw std::invalid_argument("random: negative dimension in " + shape_str(shape_));
  return {{shape_, kind_ == Kind::kInt ? DType::kI32 : DType::kF32}};
}
std::vector<Tensor> RandomFill::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                    std::span<const Tensor>, const std::vector<bool>&) const {
  throw std::logic_error("random has no inputs to differentiate");
}

// ---- in-place updates ----

namespace {

void expect_f32(const Primitive& p, const Tensor& t, size_t i, int64_t numel = -1) {
  if (t.dtype() != DType::kF32 || (numel >= 0 && t.numel() != numel))
    throw std::invalid_argument(fmt::format("{}: input {} must be float32{}, got {}", p.name(), i,
                                            numel >= 0 ? fmt::format(" of {} elements", numel) : "",
                                            t.str()));
}

void expect_like(const Primitive& p, std::span<const Tensor> in,
                 std::initializer_list<size_t> idx) {
  for (size_t i : idx) {
    expect_f32(p, in[i], i);
    if (in[i].shape() != in[0].shape())
      throw std::invalid_argument(fmt::format("{}: input {} has shape {}, input 0 has {}", p.name(),
                                              i, shape_str(in[i].shape()),
                                              shape_str(in[0].shape())));
  }
}

std::vector<Tensor> no_vjp(const Primitive& p) {
  throw std::logic_error(fmt::format("{} is an in-place update: it has no gradient", p.name()));
}

void expect_count(const Primitive& p, std::span<const Tensor> in, size_t n) {
  if (in.size() != n)
    throw std::invalid_argument(
        fmt::format("{}: expected {} inputs, got {}", p.name(), n, in.size()));
}

}  // namespace

std::vector<TensorSpec> AddInPlace::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 2);
  if (in[0].shape() != in[1].shape() || !is_floating(in[0].dtype()) || !is_floating(in[1].dtype()))
    throw std::invalid_argument(
        fmt::format("add_: expected two floating tensors of one shape, got "
                    "{} and {}",
                    in[0].str(), in[1].str()));
  return {};
}
std::vector<Tensor> AddInPlace::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                    std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

static void expect_i64_one(const Primitive& p, const Tensor& t, size_t i) {
  if (t.dtype() != DType::kI64 || t.numel() != 1)
    throw std::invalid_argument(
        fmt::format("{}: input {} must be one int64, got {}", p.name(), i, t.str()));
}

std::vector<TensorSpec> AdvanceStep::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 2);
  expect_i64_one(*this, in[0], 0);
  expect_f32(*this, in[1], 1, 1);
  return {};
}
std::vector<Tensor> AdvanceStep::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                     std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> AdamWHyper::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 2);
  expect_i64_one(*this, in[0], 0);
  expect_f32(*this, in[1], 1, 1);
  return {{{3}, DType::kF32}};
}
std::vector<Tensor> AdamWHyper::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                    std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> AdamWUpdate::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 7);
  expect_like(*this, in, {0, 1, 2, 3});
  expect_f32(*this, in[4], 4, 3);
  expect_f32(*this, in[5], 5, 1);
  expect_f32(*this, in[6], 6, 1);
  return {};
}
std::vector<Tensor> AdamWUpdate::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                     std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> SgdUpdate::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 7);
  expect_like(*this, in, {0, 1, 2});
  expect_i64_one(*this, in[3], 3);
  expect_f32(*this, in[4], 4, 1);
  expect_f32(*this, in[5], 5, 1);
  expect_f32(*this, in[6], 6, 1);
  return {};
}
std::vector<Tensor> SgdUpdate::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                   std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> GradNorm::infer(std::span<const Tensor> in) const {
  for (size_t i = 0; i < in.size(); ++i) expect_f32(*this, in[i], i);
  return {{{}, DType::kF32}};
}
std::vector<Tensor> GradNorm::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                  std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> SumSquaresBits::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 1);
  expect_f32(*this, in[0], 0);
  return {{{1}, DType::kI64}};
}
std::vector<Tensor> SumSquaresBits::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                        std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> NormOfPartialSums::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 1);
  if (in[0].dtype() != DType::kI64)
    throw std::invalid_argument("norm_of_partial_sums: input 0 must be int64, got " + in[0].str());
  return {{{}, DType::kF32}};
}
std::vector<Tensor> NormOfPartialSums::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                           std::span<const Tensor>,
                                           const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> ClipCoefficient::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 1);
  expect_f32(*this, in[0], 0, 1);
  return {{{}, DType::kF32}};
}
std::vector<Tensor> ClipCoefficient::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                         std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> ZeroInPlace::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 1);
  return {};
}
std::vector<Tensor> ZeroInPlace::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                     std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> AssignInPlace::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 2);
  if (in[0].shape() != in[1].shape() || in[0].dtype() != in[1].dtype())
    throw std::invalid_argument(fmt::format("assign_: {} into {}", in[1].str(), in[0].str()));
  return {};
}
std::vector<Tensor> AssignInPlace::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                       std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> ScaleInPlace::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 1);
  expect_f32(*this, in[0], 0);
  return {};
}
std::vector<Tensor> ScaleInPlace::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                      std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> UnscaleAndCheck::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 3);
  expect_f32(*this, in[0], 0);
  expect_f32(*this, in[1], 1, 1);
  expect_f32(*this, in[2], 2, 1);
  return {};
}
std::vector<Tensor> UnscaleAndCheck::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                         std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

std::vector<TensorSpec> ScalerUpdate::infer(std::span<const Tensor> in) const {
  expect_count(*this, in, 3);
  expect_f32(*this, in[0], 0, 1);
  if (in[1].dtype() != DType::kI64 || in[1].numel() != 1)
    throw std::invalid_argument("scaler_update: input 1 must be one int64, got " + in[1].str());
  expect_f32(*this, in[2], 2, 1);
  return {};
}
std::vector<Tensor> ScalerUpdate::vjp(std::span<const Tensor>, std::span<const Tensor>,
                                      std::span<const Tensor>, const std::vector<bool>&) const {
  return no_vjp(*this);
}

}  // namespace kuai
