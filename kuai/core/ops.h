// The op library: free functions that build a primitive and send it through dispatch(), plus
// creation functions. PyTorch names and semantics unless a comment says otherwise. Float ops
// take float32 (mixed precision casts at the dispatch point); indices are int32.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai {

// ---- creation ----
Tensor zeros(const Shape& shape, DType dtype = DType::kF32, Device device = default_device());
Tensor full(const Shape& shape, float value, DType dtype = DType::kF32,
            Device device = default_device());
// Writes `value` into every element of a contiguous tensor, on its device, outside autograd and
// capture (not dispatched): for initialisation, as torch.nn.init's functions run under no_grad.
void fill_(const Tensor& t, float value);
Tensor from_vector(const std::vector<float>& values, const Shape& shape,
                   Device device = default_device());
Tensor from_vector(const std::vector<int32_t>& values, const Shape& shape,
                   Device device = default_device());
inline Tensor from_vector(std::initializer_list<float> values, const Shape& shape,
                          Device device = default_device()) {
  return from_vector(std::vector<float>(values), shape, device);
}
Tensor arange(int64_t n, DType dtype = DType::kI32, Device device = default_device());

// ---- views (share storage; differentiable) ----
Tensor reshape(const Tensor& x, Shape shape);  // one dim may be -1; copies only if it must
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);  // equal parts
// Consecutive slices of the given sizes (they must add up to the dim): PyTorch's split(list).
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor expand(const Tensor& x, const Shape& shape);  // broadcast view (stride 0)

// ---- copies ----
Tensor contiguous(const Tensor& x);  // always copies
Tensor clone(const Tensor& x);
Tensor cast(const Tensor& x, DType dtype);
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);

// ---- elementwise, NumPy broadcasting ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& x, float s);  // s * x
Tensor gelu(const Tensor& x);            // tanh approximation
Tensor gelu_backward(const Tensor& x, const Tensor& grad);
Tensor silu(const Tensor& x);  // x sigmoid(x) (SiLU, swish)
// LLaMA's gated MLP activation on the fused gate|up projection h (..., 2F): silu(h[..., :F]) *
// h[..., F:] -> (..., F), forward and backward each one pass.
Tensor swiglu(const Tensor& h);
// Rotary position embedding of x (B, T, heads, d), Hugging Face's rotate-half layout: each head's
// dims i and i + d/2 rotated by (pos0 + t) theta^(-2i/d). Heads from rotated_heads on (-1: none)
// are copied unrotated (-1: every head is rotated). Returns a contiguous (B, T, heads, d) tensor.
Tensor rope(const Tensor& x, double theta, int64_t rotated_heads = -1, int64_t pos0 = 0);
// In place, outside autograd: a += b (same shape). Used for gradient accumulation.
void add_(const Tensor& a, const Tensor& b);
// dst = src (one shape and dtype; dst contiguous), dispatched: a captured step repeats it.
void assign_(const Tensor& dst, const Tensor& src);

// ---- reductions ----
Tensor sum(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor mean(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor sum(const Tensor& x);                         // all elements -> scalar (shape ())
Tensor mean(const Tensor& x);                        // all elements -> scalar
Tensor sum_to(const Tensor& x, const Shape& shape);  // undo broadcasting

// ---- linear algebra ----
// (..., M, K) @ (..., K, N); batch dims equal, or one side 2-D. Transposed views are free.
Tensor matmul(const Tensor& a, const Tensor& b);
// x (..., K) @ w(N, K)^T + b(N); bias may be undefined.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = Tensor());

// ---- normalisation, softmax, losses ----
// softmax(scale * x) over the last axis; causal masks column j > row's query index.
Tensor softmax(const Tensor& x, float scale = 1.0f, bool causal = false);
Tensor softmax_backward(const Tensor& y, const Tensor& grad, float scale);
struct LayerNormOut {
  Tensor y, mean, rstd;  // mean, rstd: (N) fp32, over all leading dims
};
Tensor layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, float eps = 1e-5f);
LayerNormOut layer_norm_with_stats(const Tensor& x, const Tensor& w, const Tensor& b, float eps);
// x * rsqrt(mean(x^2, -1) + eps) * w over the last axis (fp32, like layer_norm).
Tensor rms_norm(const Tensor& x, const Tensor& w, float eps = 1e-5f);
Tensor embedding(const Tensor& weight, const Tensor& indices);  // (V, C), (...) -> (..., C)
// Mean over targets != ignore_index of -log softmax(logits)[target]. logits (N, V), targets (N).
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int32_t ignore_index = -1);
// Naive causal (or not) attention: softmax(q k^T / sqrt(d)) v over (B, H, T, d) views, one
// primitive that materialises the probabilities and skips masked key blocks. The result is a
// (B, H, T, d) view of a (B, T, H, d) buffer, so merging the heads back is free.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal = true);
// The same, exact, by FlashAttention's tiles: O(T) memory (the output and one fp32 log-sum-exp per
// row are all it keeps for the backward). q may have fewer rows than k and v (B, H, tk, d): the
// new queries of a KV cache, query i at position tk - tq + i.
Tensor flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true);
// The same from matmul, softmax and matmul primitives (a cross-check in the tests).
Tensor attention_composite(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = true);

// ---- in-place updates (optimizers, clipping, the loss scaler): primitives like the others, so
// a dispatch mode sees them; the trailing underscore marks what is written in place ----
// An optimizer's device step count: count += 1 unless skip (one float) is not 0.
void advance_step_(const Tensor& count, const Tensor& skip);
// AdamW's per-step numbers (lr, 1 - beta1^t, 1 - beta2^t) from the device count and lr.
Tensor adamw_hyper(const Tensor& count, const Tensor& lr, float beta1, float beta2);
// One AdamW step of p (and its moments m, v) from g, g multiplied by grad_scale (one float) in
// the same pass; nothing when skip (one float) is not 0.
void adamw_update_(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                   const Tensor& hyper, const Tensor& grad_scale, const Tensor& skip, float beta1,
                   float beta2, float eps, float weight_decay);
// One SGD step (the first when count is 1); nothing when skip is not 0.
void sgd_update_(const Tensor& p, const Tensor& g, const Tensor& buf, const Tensor& count,
                 const Tensor& lr, const Tensor& grad_scale, const Tensor& skip, float momentum,
                 float dampening, float weight_decay, bool nesterov);
// The L2 norm over all the tensors, () fp32 (squares summed in double, in order).
Tensor global_norm(const std::vector<Tensor>& tensors);
// A float64 sum of squares as its 64 bits (1) int64, and the norm of several such partial sums.
Tensor sum_squares_bits(const Tensor& x);
Tensor norm_of_partial_sums(const Tensor& bits);
// min(1, max_norm / (norm + 1e-6)) of a () fp32 norm; 1 when max_norm <= 0.
Tensor clip_factor(const Tensor& norm, float max_norm);
void scale_(const Tensor& x, float c);
// g *= 1 / scale; found_inf = 1 when g holds an inf or NaN.
void unscale_and_check_(const Tensor& g, const Tensor& scale, const Tensor& found_inf);
// The dynamic loss scale's update from found_inf (kuai/core/primitives.h: ScalerUpdate).
void scaler_update_(const Tensor& scale, const Tensor& tracker, const Tensor& found_inf,
                    float backoff, float growth, int64_t growth_interval);

// ---- operators ----
inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator*(const Tensor& a, float s) { return scale(a, s); }
inline Tensor operator*(float s, const Tensor& a) { return scale(a, s); }
inline Tensor operator/(const Tensor& a, float s) { return scale(a, 1.0f / s); }

}  // namespace kuai
