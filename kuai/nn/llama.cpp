// The LLaMA block (see llama.h).
#include "kuai/nn/llama.h"

#include <fmt/format.h>

#include <stdexcept>

#include "kuai/core/ops.h"

namespace kuai::nn {

LlamaAttention::LlamaAttention(const GPTConfig& cfg, Generator& gen)
    : n_head_(cfg.n_head), n_kv_head_(cfg.kv_heads()), rope_theta_(cfg.rope_theta) {
  head_dim_ = cfg.d_model / n_head_;
  const int64_t C = cfg.d_model, width = (n_head_ + 2 * n_kv_head_) * head_dim_;
  qkv_proj_ = register_module("qkv_proj", std::make_shared<Linear>(C, width, false, gen));
  o_proj_ = register_module("o_proj", std::make_shared<Linear>(n_head_ * head_dim_, C, false, gen));
}

std::vector<Tensor> LlamaAttention::project(const Tensor& x, int64_t pos0) const {
  const int64_t B = x.size(0), t = x.size(1), H = n_head_, Hkv = n_kv_head_;
  // (B, t, H + 2 Hkv, hd): q and k heads rotated, v carried along in the same pass.
  Tensor qkv = reshape(qkv_proj_->forward(x), {B, t, H + 2 * Hkv, head_dim_});
  std::vector<Tensor> parts = split(rope(qkv, rope_theta_, H + Hkv, pos0), {H, Hkv, Hkv}, 2);
  for (Tensor& p : parts) p = transpose(p, 1, 2);  // (B, heads, t, hd) views
  return parts;
}

Tensor LlamaAttention::forward(const Tensor& x) const {
  const int64_t B = x.size(0), T = x.size(1);
  const std::vector<Tensor> qkv = project(x, 0);
  // (B, H, T, hd); the key/value heads are shared by their groups inside the kernels.
  Tensor y = use_flash(qkv[0], qkv[1])
                 ? flash_attention(qkv[0], qkv[1], qkv[2], /*causal=*/true)
                 : scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*causal=*/true);
  return o_proj_->forward(reshape(transpose(y, 1, 2), {B, T, n_head_ * head_dim_}));
}

Tensor LlamaAttention::forward_cached(const Tensor& x, LayerKV& kv) const {
  const int64_t B = x.size(0), t = x.size(1), H = n_head_, Hkv = n_kv_head_, hd = head_dim_;
  const bool prefill = !kv.k.defined();
  if (!prefill && t != 1)
    throw std::invalid_argument(
        fmt::format("attention: a filled KV cache takes one token at a time, got {}", t));
  const int64_t pos0 = prefill ? 0 : kv.k.size(2);
  const std::vector<Tensor> qkv = project(x, pos0);
  const Tensor k = contiguous(qkv[1]), v = contiguous(qkv[2]);  // (B, Hkv, t, hd)
  kv.k = prefill ? k : cat({kv.k, k}, 2);
  kv.v = prefill ? v : cat({kv.v, v}, 2);
  Tensor y;  // (B, H, t, hd)
  if (impl_ != AttentionImpl::kNaive) {
    y = flash_attention(qkv[0], kv.k, kv.v, /*causal=*/true);
  } else if (prefill) {
    y = scaled_dot_product_attention(qkv[0], kv.k, kv.v, /*causal=*/true);
  } else {
    // One query row per head: the G query heads of a group are G rows against its keys.
    const int64_t G = H / Hkv;
    Tensor q = reshape(contiguous(qkv[0]), {B, Hkv, G, hd});
    y = reshape(attention_composite(q, kv.k, kv.v, /*causal=*/false), {B, H, 1, hd});
  }
  return o_proj_->forward(reshape(transpose(y, 1, 2), {B, t, H * hd}));
}

LlamaMLP::LlamaMLP(int64_t d_model, int64_t hidden, Generator& gen) {
  gate_up_proj_ =
      register_module("gate_up_proj", std::make_shared<Linear>(d_model, 2 * hidden, false, gen));
  down_proj_ = register_module("down_proj", std::make_shared<Linear>(hidden, d_model, false, gen));
}

Tensor LlamaMLP::forward(const Tensor& x) const {
  return down_proj_->forward(swiglu(gate_up_proj_->forward(x)));
}

LlamaBlock::LlamaBlock(const GPTConfig& cfg, Generator& gen) {
  const float eps = static_cast<float>(cfg.norm_eps);
  input_layernorm_ =
      register_module("input_layernorm", std::make_shared<RMSNorm>(cfg.d_model, eps));
  self_attn_ = register_module("self_attn", std::make_shared<LlamaAttention>(cfg, gen));
  post_attention_layernorm_ =
      register_module("post_attention_layernorm", std::make_shared<RMSNorm>(cfg.d_model, eps));
  mlp_ = register_module("mlp", std::make_shared<LlamaMLP>(cfg.d_model, cfg.ffn(), gen));
}

Tensor LlamaBlock::forward(const Tensor& x) const {
  Tensor h = add(x, self_attn_->forward(input_layernorm_->forward(x)));
  return add(h, mlp_->forward(post_attention_layernorm_->forward(h)));
}

Tensor LlamaBlock::forward_cached(const Tensor& x, LayerKV& kv) const {
  Tensor h = add(x, self_attn_->forward_cached(input_layernorm_->forward(x), kv));
  return add(h, mlp_->forward(post_attention_layernorm_->forward(h)));
}

}  // namespace kuai::nn
