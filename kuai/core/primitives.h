// The primitive classes, one per op. infer() and vjp() are defined in primitives.cpp; each
// eval_cpu() in backend/cpu/eval_<family>.cpp. Adding an op means: a class here, its eval, its
// vjp, its test entry in tests/core/test_ops.cpp.
#pragma once

#include "kuai/core/primitive.h"

namespace kuai {

#define KUAI_PRIMITIVE_COMMON(NAME, CLASS)                                                  \
  std::string_view name() const override { return NAME; }                                   \
  OpClass op_class() const override { return CLASS; }                                       \
  std::vector<TensorSpec> infer(std::span<const Tensor> in) const override;                 \
  void eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const override;          \
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,          \
                          std::span<const Tensor> grad_out, const std::vector<bool>& needs) \
      const override;

// ---- views: no evaluation, outputs alias the input ----
class ViewPrimitive : public Primitive {
 public:
  OpClass op_class() const override { return OpClass::kView; }
  bool is_view() const override { return true; }
  bool accepts_strided(size_t) const override { return true; }
  bool saves_input(size_t) const override { return false; }
  std::vector<TensorSpec> infer(std::span<const Tensor> in) const override;
  void eval_cpu(std::span<const Tensor>, std::span<Tensor>) const override;
};

class View final : public ViewPrimitive {  // reshape without a copy (strides must allow it)
 public:
  View(Shape shape, Shape strides) : shape_(std::move(shape)), strides_(std::move(strides)) {}
  std::string_view name() const override { return "view"; }
  std::vector<Tensor> make_views(std::span<const Tensor> in) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;

 private:
  Shape shape_, strides_;
};

// A view at an offset from the input's own (elements): what a graph capture records for a
// tensor that code made with Tensor::view_of instead of a view op (a vjp returning parts of one
// buffer), so that a replay makes the same view of the new buffer. Not differentiable.
class AsStrided final : public ViewPrimitive {
 public:
  AsStrided(Shape shape, Shape strides, int64_t offset)
      : shape_(std::move(shape)), strides_(std::move(strides)), offset_(offset) {}
  std::string_view name() const override { return "as_strided"; }
  std::vector<Tensor> make_views(std::span<const Tensor> in) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;
  bool differentiable(size_t) const override { return false; }

 private:
  Shape shape_, strides_;
  int64_t offset_;
};

class Permute final : public ViewPrimitive {
 public:
  explicit Permute(std::vector<int64_t> dims) : dims_(std::move(dims)) {}
  std::string_view name() const override { return "permute"; }
  std::vector<Tensor> make_views(std::span<const Tensor> in) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;

 private:
  std::vector<int64_t> dims_;
};

class Expand final : public ViewPrimitive {  // broadcast to a larger shape with stride 0
 public:
  explicit Expand(Shape shape) : shape_(std::move(shape)) {}
  std::string_view name() const override { return "expand"; }
  std::vector<Tensor> make_views(std::span<const Tensor> in) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;

 private:
  Shape shape_;
};

class Chunk final : public ViewPrimitive {  // `chunks` equal slices along dim, as outputs
 public:
  Chunk(int64_t chunks, int64_t dim) : chunks_(chunks), dim_(dim) {}
  std::string_view name() const override { return "chunk"; }
  std::vector<Tensor> make_views(std::span<const Tensor> in) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;

 private:
  int64_t chunks_, dim_;
};

// Consecutive slices of the given sizes along dim (PyTorch's split with a list), as outputs; like
// chunk, gradients that a primitive wrote side by side into one buffer join back without a copy.
class Split final : public ViewPrimitive {
 public:
  Split(std::vector<int64_t> sizes, int64_t dim) : sizes_(std::move(sizes)), dim_(dim) {}
  std::string_view name() const override { return "split"; }
  std::vector<Tensor> make_views(std::span<const Tensor> in) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;

 private:
  std::vector<int64_t> sizes_;
  int64_t dim_;
};

class Narrow final : public ViewPrimitive {
 public:
  Narrow(int64_t dim, int64_t start, int64_t length) : dim_(dim), start_(start), length_(length) {}
  std::string_view name() const override { return "narrow"; }
  std::vector<Tensor> make_views(std::span<const Tensor> in) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;

 private:
  int64_t dim_, start_, length_;
};

// ---- copies ----
class Copy final : public Primitive {  // strided -> contiguous
 public:
  KUAI_PRIMITIVE_COMMON("copy", OpClass::kElementwise)
  bool accepts_strided(size_t) const override { return true; }
  bool saves_input(size_t) const override { return false; }
};

class Cast final : public Primitive {
 public:
  explicit Cast(DType to) : to_(to) {}
  KUAI_PRIMITIVE_COMMON("cast", OpClass::kElementwise)
  bool saves_input(size_t) const override { return false; }

 private:
  DType to_;
};

class Concat final : public Primitive {
 public:
  explicit Concat(int64_t dim) : dim_(dim) {}
  KUAI_PRIMITIVE_COMMON("cat", OpClass::kOther)
  bool accepts_strided(size_t) const override { return true; }
  bool saves_input(size_t) const override { return false; }

 private:
  int64_t dim_;
};

// Gradient of narrow: a zero tensor of `shape` with the slice set to the input.
class NarrowBackward final : public Primitive {
 public:
  NarrowBackward(Shape shape, int64_t dim, int64_t start)
      : shape_(std::move(shape)), dim_(dim), start_(start) {}
  KUAI_PRIMITIVE_COMMON("narrow_backward", OpClass::kOther)
  bool saves_input(size_t) const override { return false; }

 private:
  Shape shape_;
  int64_t dim_, start_;
};

// ---- elementwise ----
enum class BinaryOp { kAdd, kSub, kMul, kDiv };
class Binary final : public Primitive {
 public:
  explicit Binary(BinaryOp op) : op_(op) {}
  std::string_view name() const override;
  OpClass op_class() const override { return OpClass::kElementwise; }
  std::vector<TensorSpec> infer(std::span<const Tensor> in) const override;
  void eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const override;
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,
                          std::span<const Tensor> grad_out,
                          const std::vector<bool>& needs) const override;
  bool saves_input(size_t i) const override {
    return op_ == BinaryOp::kMul || op_ == BinaryOp::kDiv;
  }
  int in_place_input(size_t) const override { return 0; }  // index-wise: y[i] from a[i], b[.]
  BinaryOp op() const { return op_; }

 private:
  BinaryOp op_;
};

class Scale final : public Primitive {
 public:
  explicit Scale(float s) : s_(s) {}
  KUAI_PRIMITIVE_COMMON("scale", OpClass::kElementwise)
  bool saves_input(size_t) const override { return false; }
  int in_place_input(size_t) const override { return 0; }

 private:
  float s_;
};

class Gelu final : public Primitive {
 public:
  KUAI_PRIMITIVE_COMMON("gelu", OpClass::kElementwise)
  int in_place_input(size_t) const override { return 0; }
};

class Silu final : public Primitive {  // x sigmoid(x), in the input's dtype
 public:
  KUAI_PRIMITIVE_COMMON("silu", OpClass::kElementwise)
  int in_place_input(size_t) const override { return 0; }
};

class SiluBackward final : public Primitive {  // (x, dy) -> dx
 public:
  KUAI_PRIMITIVE_COMMON("silu_backward", OpClass::kElementwise)
  int in_place_input(size_t) const override { return 1; }
};

// LLaMA's gate: h (..., 2F) holding gate | up side by side (one fused linear) -> (..., F)
// silu(gate) * up, in h's dtype (fp32 math, one rounding).
class SwiGLU final : public Primitive {
 public:
  KUAI_PRIMITIVE_COMMON("swiglu", OpClass::kElementwise)
};

// (h, dy) -> dh (..., 2F): the gradients of gate and up side by side, i.e. the gradient of the
// fused linear's output. Index-wise over h, so dh may be written over h.
class SwiGLUBackward final : public Primitive {
 public:
  KUAI_PRIMITIVE_COMMON("swiglu_backward", OpClass::kElementwise)
  int in_place_input(size_t) const override { return 0; }
};

// Rotary position embedding (backend/cpu/rope.cpp; Hugging Face's rotate-half layout) of x (B, T,
// heads, d), any strides with a unit last one -> (B, T, heads, d) contiguous in x's dtype: heads
// [0, rotated_heads) rotated by position pos0 + t, the others copied (so one op covers q and k of
// a fused qkv and carries v along). The backward is the inverse rotation of the gradient.
class Rope final : public Primitive {
 public:
  Rope(double theta, int64_t rotated_heads, int64_t pos0, bool inverse)
      : theta_(theta), rotated_heads_(rotated_heads), pos0_(pos0), inverse_(inverse) {}
  KUAI_PRIMITIVE_COMMON("rope", OpClass::kElementwise)
  bool accepts_strided(size_t) const override { return true; }
  bool saves_input(size_t) const override { return false; }
  int in_place_input(size_t) const override { return 0; }

 private:
  double theta_;
  int64_t rotated_heads_, pos0_;
  bool inverse_;
};

class GeluBackward final : public Primitive {  // (x, dy) -> dx
 public:
  KUAI_PRIMITIVE_COMMON("gelu_backward", OpClass::kElementwise)
  int in_place_input(size_t) const override { return 1; }  // dx over dy
};

// ---- reductions ----
class Sum final : public Primitive {
 public:
  Sum(int64_t dim, bool keepdim) : dim_(dim), keepdim_(keepdim) {}
  int64_t dim() const { return dim_; }
  KUAI_PRIMITIVE_COMMON("sum", OpClass::kReduction)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  bool saves_input(size_t) const override { return false; }

 private:
  int64_t dim_;
  bool keepdim_;
};

// ---- linear algebra ----
class Matmul final : public Primitive {
 public:
  KUAI_PRIMITIVE_COMMON("matmul", OpClass::kMatmul)
  bool accepts_strided(size_t) const override { return true; }
  Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const override;
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
};

class Linear final : public Primitive {  // (x, w[, b])
 public:
  KUAI_PRIMITIVE_COMMON("linear", OpClass::kMatmul)
  bool saves_input(size_t i) const override { return i < 2; }
  Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const override;
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
};

// ---- normalisation, softmax, losses ----
class Softmax final : public Primitive {
 public:
  Softmax(float scale, bool causal) : scale_(scale), causal_(causal) {}
  KUAI_PRIMITIVE_COMMON("softmax", OpClass::kNormalization)
  bool saves_input(size_t) const override { return false; }
  bool saves_output(size_t) const override { return true; }

 private:
  float scale_;
  bool causal_;
};

class SoftmaxBackward final : public Primitive {  // (y, dy) -> dx
 public:
  explicit SoftmaxBackward(float scale) : scale_(scale) {}
  KUAI_PRIMITIVE_COMMON("softmax_backward", OpClass::kNormalization)
  int in_place_input(size_t) const override { return 1; }  // dx over dy: the row's dot comes first

 private:
  float scale_;
};

class LayerNorm final : public Primitive {  // (x, w, b) -> (y, mean, rstd)
 public:
  explicit LayerNorm(float eps) : eps_(eps) {}
  KUAI_PRIMITIVE_COMMON("layer_norm", OpClass::kNormalization)
  bool saves_input(size_t i) const override { return i < 2; }
  bool saves_output(size_t j) const override { return j > 0; }
  float eps() const { return eps_; }

 private:
  float eps_;
};

// The residual add and the LayerNorm that reads its sum, in one pass over the rows (a compiled
// graph's fusion, kuai/compile/passes.h): (a, b, w, bias) -> (x = a + b, y, mean, rstd), a fp32,
// b fp32 or a bf16 / f16 branch (widened exactly, as the mixed add does), each
// output bit for bit what add then layer_norm give (the sum is rounded once either way, and each
// row's statistics are the same function of the same row). Never recorded by autograd.
class AddLayerNorm final : public Primitive {
 public:
  explicit AddLayerNorm(float eps) : eps_(eps) {}
  KUAI_PRIMITIVE_COMMON("add_layer_norm", OpClass::kNormalization)
  float eps() const { return eps_; }
  int in_place_input(size_t out) const override { return out == 0 ? 0 : -1; }  // x over a

 private:
  float eps_;
};

// RMSNorm (Zhang and Sennrich, 2019), LLaMA's norm: (x, w) -> (y = x rstd w, rstd (N) fp32),
// rstd = 1 / sqrt(mean(x^2) + eps) over the last axis.
class RMSNorm final : public Primitive {
 public:
  explicit RMSNorm(float eps) : eps_(eps) {}
  KUAI_PRIMITIVE_COMMON("rms_norm", OpClass::kNormalization)
  bool saves_output(size_t j) const override { return j == 1; }
  float eps() const { return eps_; }

 private:
  float eps_;
};

class RMSNormBackward final : public Primitive {  // (x, w, rstd, dy) -> (dx, dw)
 public:
  KUAI_PRIMITIVE_COMMON("rms_norm_backward", OpClass::kNormalization)
  int in_place_input(size_t out) const override { return out == 0 ? 3 : -1; }  // dx over dy
};

class LayerNormBackward final : public Primitive {  // (x, w, mean, rstd, dy) -> (dx, dw, db)
 public:
  KUAI_PRIMITIVE_COMMON("layer_norm_backward", OpClass::kNormalization)
  // dx over dy: each row's sums are taken before its dx is written. dw, db are new.
  int in_place_input(size_t out) const override { return out == 0 ? 4 : -1; }
};

// A chain of fp32 elementwise primitives (add, sub, mul, div of one shape, scale, gelu,
// gelu_backward) evaluated a block of elements at a time (a compiled graph's fusion,
// kuai/compile/passes.h): each step runs its own kernel on the block, its result kept in a
// thread-private buffer until the next step reads it, so only the chain's inputs and its last
// output go through memory. The same kernels on the same elements: bit for bit the chain.
class FusedElementwise final : public Primitive {
 public:
  struct Step {
    std::shared_ptr<const Primitive> op;
    std::vector<int> args;  // k >= 0: input k of the fused node; -1 - j: the result of step j
  };
  static constexpr int64_t kBlock = 4096;  // elements per block (a multiple of every vector width)
  explicit FusedElementwise(std::vector<Step> steps) : steps_(std::move(steps)) {}
  KUAI_PRIMITIVE_COMMON("fused_elementwise", OpClass::kElementwise)
  // The last step's output over an input: every step of a block reads it before the last writes.
  int in_place_input(size_t) const override { return 0; }
  const std::vector<Step>& steps() const { return steps_; }
  // Scratch its evaluation takes with `threads` OpenMP threads (the per-thread step buffers).
  int64_t scratch_bytes(int threads) const;

 private:
  std::vector<Step> steps_;
};

// Graph fusions of the backward pass (kuai/compile/passes.h), never recorded by autograd; each is
// bit for bit the ops it replaces.
//
// (x, w, mean, rstd, dy, acc!) -> (dw, db): layer_norm_backward with its dx added into acc (the
// residual gradient) instead of stored, so dx never goes through memory.
class LayerNormBackwardAdd final : public Primitive {
 public:
  KUAI_PRIMITIVE_COMMON("layer_norm_backward_add_", OpClass::kNormalization)
  bool mutates_input(size_t i) const override { return i == 5; }
  bool updates_in_place() const override { return true; }
};

// (x, dy) -> (dx, db): gelu_backward and the bias gradient sum(dx) over every row (db of the
// shape the replaced sum gave), each block of dx summed while it is in cache.
class GeluBackwardSum final : public Primitive {
 public:
  explicit GeluBackwardSum(Shape db_shape) : db_shape_(std::move(db_shape)) {}
  KUAI_PRIMITIVE_COMMON("gelu_backward_sum", OpClass::kElementwise)
  int in_place_input(size_t out) const override { return out == 0 ? 1 : -1; }  // dx over dy

 private:
  Shape db_shape_;
};

// (logits, targets, dloss) -> (loss, lse, count, dlogits): cross_entropy and its backward in one
// pass over each block of rows; dlogits may be written over the logits.
class CrossEntropyWithGrad final : public Primitive {
 public:
  explicit CrossEntropyWithGrad(int32_t ignore_index) : ignore_(ignore_index) {}
  KUAI_PRIMITIVE_COMMON("cross_entropy_with_grad", OpClass::kNormalization)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }
  int in_place_input(size_t out) const override { return out == 3 ? 0 : -1; }
  int32_t ignore_index() const { return ignore_; }

 private:
  int32_t ignore_;
};

class Embedding final : public Primitive {  // (weight, indices) -> rows
 public:
  KUAI_PRIMITIVE_COMMON("embedding", OpClass::kOther)
  bool saves_input(size_t i) const override { return i == 1; }
  bool differentiable(size_t i) const override { return i == 0; }
};

class EmbeddingBackward final : public Primitive {  // (indices, dout) -> dweight (V, C)
 public:
  explicit EmbeddingBackward(int64_t num_embeddings) : num_(num_embeddings) {}
  KUAI_PRIMITIVE_COMMON("embedding_backward", OpClass::kOther)

 private:
  int64_t num_;
};

class CrossEntropy final : public Primitive {  // (logits, targets) -> (loss, lse, count)
 public:
  explicit CrossEntropy(int32_t ignore_index) : ignore_(ignore_index) {}
  int32_t ignore_index() const { return ignore_; }
  KUAI_PRIMITIVE_COMMON("cross_entropy", OpClass::kNormalization)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  // fp32 arithmetic on logits of any floating dtype: no fp32 copy of (N, V) under autocast.
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }
  bool saves_output(size_t j) const override { return j > 0; }
  bool differentiable(size_t i) const override { return i == 0; }

 private:
  int32_t ignore_;
};

// (logits, targets, lse, count, dloss) -> dlogits
class CrossEntropyBackward final : public Primitive {
 public:
  explicit CrossEntropyBackward(int32_t ignore_index) : ignore_(ignore_index) {}
  int32_t ignore_index() const { return ignore_; }
  KUAI_PRIMITIVE_COMMON("cross_entropy_backward", OpClass::kNormalization)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  int reusable_input(size_t out) const override { return 0; }  // dlogits over the logits

 private:
  int32_t ignore_;
};

// ---- attention ----
// Naive (materialised-probability) attention: (q (B, H, T, d), k, v (B, Hkv, T, d)), any strides
// with a unit last one -> (y laid out (B, T, H, d), p (B, H, T, T)). Causal skips masked key
// blocks. Hkv divides H: grouped-query attention, query head h reading key/value head h / (H /
// Hkv) where it lies (no repeated copies); Hkv == H is multi-head attention.
class Attention final : public Primitive {
 public:
  Attention(float scale, bool causal) : scale_(scale), causal_(causal) {}
  KUAI_PRIMITIVE_COMMON("attention", OpClass::kAttention)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  bool accepts_strided(size_t) const override { return true; }
  Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const override;
  bool saves_output(size_t j) const override { return j == 1; }
  // y; the (B, H, T, T) probabilities are made again (Megatron's selective recomputation).
  bool kept_by_selective_recompute(size_t j) const override { return j == 0; }

 private:
  float scale_;
  bool causal_;
};

// (q, k, v, p, dy laid out (B, T, H, d)) -> one (B, T, H + 2 Hkv, d) tensor holding dq, dk, dv side
// by side: the layout of the fused qkv projection's output, so the gradients of its chunks join
// back into it without a copy. vjp hands out the three (B, heads, T, d) views. With groups, each
// key/value head's gradient is the sum over its query heads (in head order, accumulated in fp32;
// in bf16 / f16 each head's part is rounded first, as PyTorch's repeat_kv backward does).
class AttentionBackward final : public Primitive {
 public:
  AttentionBackward(float scale, bool causal) : scale_(scale), causal_(causal) {}
  KUAI_PRIMITIVE_COMMON("attention_backward", OpClass::kAttention)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  bool accepts_strided(size_t) const override { return true; }
  Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const override;

 private:
  float scale_;
  bool causal_;
};

// FlashAttention (backend/cpu/flash_attention.h): (q (B, H, tq, d), k, v (B, Hkv, tk, d); Hkv
// dividing H, as for Attention), any strides with a unit last one -> (y laid out (B, tq, H, d) in
// q's dtype, lse (B, H, tq) fp32). Nothing of size T x T exists at any time; the backward
// recomputes the probabilities from lse. With fewer queries than keys (a KV cache) query i sits at
// position tk - tq + i.
class FlashAttention final : public Primitive {
 public:
  FlashAttention(float scale, bool causal) : scale_(scale), causal_(causal) {}
  KUAI_PRIMITIVE_COMMON("flash_attention", OpClass::kAttention)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  bool accepts_strided(size_t) const override { return true; }
  Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const override;
  bool saves_output(size_t) const override { return true; }  // y and lse

 private:
  float scale_;
  bool causal_;
};

// (q, k, v, y, lse, dy laid out (B, T, H, d)) -> (B, T, H + 2 Hkv, d) holding dq, dk, dv side by
// side, as AttentionBackward (tq == tk).
class FlashAttentionBackward final : public Primitive {
 public:
  FlashAttentionBackward(float scale, bool causal) : scale_(scale), causal_(causal) {}
  KUAI_PRIMITIVE_COMMON("flash_attention_backward", OpClass::kAttention)
  std::vector<int64_t> cpu_scratch(std::span<const Tensor> in,
                                   std::span<const Tensor> out) const override;
  bool accepts_strided(size_t) const override { return true; }
  Cost cost(std::span<const Tensor> in, std::span<const Tensor> out) const override;
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }

 private:
  float scale_;
  bool causal_;
};

// ---- creation ----
// () -> shape of dtype, every element `value` (full, zeros): a primitive, so that a captured step
// makes its scratch tensors (a zeroed overflow flag, backward's seed gradient) anew when it is
// replayed instead of reusing what the capture left in them.
class Fill final : public Primitive {
 public:
  Fill(Shape shape, DType dtype, float value, Device device = kCPU)
      : shape_(std::move(shape)), dtype_(dtype), value_(value), device_(device) {}
  KUAI_PRIMITIVE_COMMON("fill", OpClass::kOther)
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }
  bool differentiable(size_t) const override { return false; }
  Device output_device() const override { return device_; }

 private:
  Shape shape_;
  DType dtype_;
  float value_;
  Device device_;
};

// 0, 1, ..., n-1 as float32 (exact to 2^24).
class Arange final : public Primitive {
 public:
  Arange(int64_t n, Device device) : n_(n), device_(device) {}
  KUAI_PRIMITIVE_COMMON("arange", OpClass::kOther)
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }
  bool differentiable(size_t) const override { return false; }
  Device output_device() const override { return device_; }

 private:
  int64_t n_;
  Device device_;
};

// Philox draws (core/rng.h) at a fixed (seed, stream, offset): element i is a pure function of
// them and i, on every backend and at every thread count. kNormal: float32 N(a, b^2); kUniform:
// float32 in [a, b); kInt: int32 in [a, b).
class RandomFill final : public Primitive {
 public:
  enum class Kind { kNormal, kUniform, kInt };
  RandomFill(Kind kind, Shape shape, uint64_t seed, uint64_t stream, uint64_t offset, double a,
             double b, Device device)
      : kind_(kind),
        shape_(std::move(shape)),
        seed_(seed),
        stream_(stream),
        offset_(offset),
        a_(a),
        b_(b),
        device_(device) {}
  KUAI_PRIMITIVE_COMMON("random", OpClass::kOther)
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }
  bool differentiable(size_t) const override { return false; }
  Device output_device() const override { return device_; }

 private:
  Kind kind_;
  Shape shape_;
  uint64_t seed_, stream_, offset_;
  double a_, b_;
  Device device_;
};

// ---- in-place updates: the optimizers, gradient clipping and the fp16 loss scaler ----
// They run at the dispatch point like every op, so a mode sees them (a captured step holds its
// optimizer). Inputs marked "!" are written in place (contiguous, never recorded by autograd).
// Per-step numbers (the learning rate, Adam's bias corrections, the loss scale) are tensor
// inputs, not constructor arguments, so the same primitive serves every step. None of them is
// differentiable. (The macro stays defined: kuai/distributed's collectives are updates too.)
#define KUAI_UPDATE_COMMON(NAME)                                                            \
  std::string_view name() const override { return NAME; }                                   \
  OpClass op_class() const override { return OpClass::kOther; }                             \
  CastPolicy cast_policy() const override { return CastPolicy::kAsIs; }                     \
  std::vector<TensorSpec> infer(std::span<const Tensor> in) const override;                 \
  void eval_cpu(std::span<const Tensor> in, std::span<Tensor> out) const override;          \
  std::vector<Tensor> vjp(std::span<const Tensor> in, std::span<const Tensor> out,          \
                          std::span<const Tensor> grad_out, const std::vector<bool>& needs) \
      const override;                                                                       \
  bool differentiable(size_t) const override { return false; }

// (a!, b): a += b, b of a's shape; low-precision operands summed in fp32 and rounded once into a.
// The autograd engine accumulates gradients with it, so a mode sees the accumulation.
class AddInPlace final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("add_")
  bool mutates_input(size_t i) const override { return i == 0; }
  bool updates_in_place() const override { return true; }
};

// (count! (1) int64, skip (1) fp32): an optimizer's step count, advanced by one unless skip is
// not 0 (the fp16 scaler's found_inf; NaN skips too). It lives on the device, so a skipped step
// is decided where the flag is.
class AdvanceStep final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("advance_step_")
  bool mutates_input(size_t i) const override { return i == 0; }
  bool updates_in_place() const override { return true; }
};

// (count (1) int64, lr (1) fp32) -> (3) fp32: AdamW's per-step numbers, lr, 1 - beta1^t and
// 1 - beta2^t for t = count (computed in double, rounded once), from device values.
class AdamWHyper final : public Primitive {
 public:
  AdamWHyper(float beta1, float beta2) : beta1_(beta1), beta2_(beta2) {}
  KUAI_UPDATE_COMMON("adamw_hyper")

 private:
  float beta1_, beta2_;
};

// (p!, g, m!, v!, hyper (3), grad_scale (1), skip (1)): one AdamW step of a tensor, g multiplied
// by grad_scale in the same pass (clipping, unscaling); nothing when skip is not 0.
class AdamWUpdate final : public Primitive {
 public:
  AdamWUpdate(float beta1, float beta2, float eps, float weight_decay)
      : beta1_(beta1), beta2_(beta2), eps_(eps), weight_decay_(weight_decay) {}
  KUAI_UPDATE_COMMON("adamw_update")
  bool mutates_input(size_t i) const override { return i == 0 || i == 2 || i == 3; }
  bool updates_in_place() const override { return true; }

 private:
  float beta1_, beta2_, eps_, weight_decay_;
};

// (p!, g, buf!, count (1) int64, lr (1), grad_scale (1), skip (1)): one SGD step, PyTorch's
// semantics (kuai/backend/cpu/kernels.h); the first step (count 1) sets the momentum buffer.
// Nothing when skip is not 0.
class SgdUpdate final : public Primitive {
 public:
  SgdUpdate(float momentum, float dampening, float weight_decay, bool nesterov)
      : momentum_(momentum),
        dampening_(dampening),
        weight_decay_(weight_decay),
        nesterov_(nesterov) {}
  KUAI_UPDATE_COMMON("sgd_update")
  bool mutates_input(size_t i) const override { return i == 0 || i == 2; }
  bool updates_in_place() const override { return true; }

 private:
  float momentum_, dampening_, weight_decay_;
  bool nesterov_;
};

// (g_1, ..., g_n) -> () fp32: the L2 norm of all of them, squares summed in double in a fixed
// order (each tensor's own deterministic sum, then the tensors in order), rounded once.
class GradNorm final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("grad_norm")
};

// (x) -> (1) int64: the float64 sum of x's squares, as its 64 bits (kuai has no float64 tensor
// dtype); ZeRO all-gathers these partial sums and NormOfPartialSums adds them in rank order.
class SumSquaresBits final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("sum_squares_bits")
};

// (bits (n) int64) -> () fp32: sqrt of the sum of the n float64 partial sums, in order.
class NormOfPartialSums final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("norm_of_partial_sums")
};

// (norm ()) -> () fp32: min(1, max_norm / (norm + 1e-6)), PyTorch's clip factor; 1 when
// max_norm <= 0.
class ClipCoefficient final : public Primitive {
 public:
  explicit ClipCoefficient(float max_norm) : max_norm_(max_norm) {}
  KUAI_UPDATE_COMMON("clip_coefficient")

 private:
  float max_norm_;
};

// (x!) : x = 0, in place (DDP's zero_grad of its gradient buckets, which must stay where they are).
class ZeroInPlace final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("zero_")
  bool mutates_input(size_t i) const override { return i == 0; }
  bool updates_in_place() const override { return true; }
};

// (dst!, src): dst = src, of one shape and dtype. Tensor::copy_ goes straight to the backend,
// unseen by a dispatch mode; code a captured step must repeat (ZeRO's shard copies, a gradient
// moved into its bucket) copies with this.
class AssignInPlace final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("assign_")
  bool mutates_input(size_t i) const override { return i == 0; }
  bool updates_in_place() const override { return true; }
};

// (x!) : x *= c, in place (clip_grad_norm_'s scaling).
class ScaleInPlace final : public Primitive {
 public:
  explicit ScaleInPlace(float c) : c_(c) {}
  KUAI_UPDATE_COMMON("scale_")
  bool mutates_input(size_t i) const override { return i == 0; }
  bool updates_in_place() const override { return true; }

 private:
  float c_;
};

// (g!, scale (1), found_inf! (1)): g *= 1 / scale (the reciprocal rounded once, exact for powers
// of two); found_inf set to 1 when any element of g is inf or NaN.
class UnscaleAndCheck final : public Primitive {
 public:
  KUAI_UPDATE_COMMON("unscale_and_check")
  bool mutates_input(size_t i) const override { return i == 0 || i == 2; }
  bool updates_in_place() const override { return true; }
};

// (scale! (1) fp32, tracker! (1) int64, found_inf (1)): the dynamic loss scale's update. An
// overflow (found_inf != 0, NaN included) multiplies the scale by backoff (never below FLT_MIN)
// and resets the tracker; otherwise the tracker counts up and at growth_interval the scale
// grows by growth (kept when the result would be inf) and the tracker resets.
class ScalerUpdate final : public Primitive {
 public:
  ScalerUpdate(float backoff, float growth, int64_t growth_interval)
      : backoff_(backoff), growth_(growth), growth_interval_(growth_interval) {}
  KUAI_UPDATE_COMMON("scaler_update")
  bool mutates_input(size_t i) const override { return i == 0 || i == 1; }
  bool updates_in_place() const override { return true; }

 private:
  float backoff_, growth_;
  int64_t growth_interval_;
};

#undef KUAI_PRIMITIVE_COMMON

}  // namespace kuai
