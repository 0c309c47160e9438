// LLaMA's decoder block (Touvron et al., 2023), as Hugging Face's LlamaForCausalLM computes it:
//   h = x + o_proj(attention(rope(q), rope(k), v))   with q, k, v from input_layernorm(x)
//   y = h + down_proj(silu(gate_proj(n)) * up_proj(n)) with n = post_attention_layernorm(h)
// RMSNorm, rotary positions in the rotate-half layout, grouped-query attention (n_kv_head key/value
// heads shared by groups of query heads, read where they lie), no biases. The q, k, v projections
// are one fused linear (qkv_proj: q rows, then k, then v) and gate and up another (gate_up_proj:
// gate rows, then up), so each is one GEMM whose output gradient the next op's backward writes in
// place; Hugging Face's separate tensors are their row blocks (io/hf_llama.h converts).
#pragma once

#include <memory>

#include "kuai/nn/gpt.h"
#include "kuai/nn/layers.h"

namespace kuai::nn {

class LlamaAttention : public AttentionModule {
 public:
  LlamaAttention(const GPTConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) const;  // (B, T, C) -> (B, T, C), positions 0..T-1
  // As CausalSelfAttention::forward_cached: positions kv's length.. ; kv holds rotated keys.
  Tensor forward_cached(const Tensor& x, LayerKV& kv) const;

 private:
  // q (B, H, t, hd), k, v (B, Hkv, t, hd) views of the rotated qkv at positions pos0..
  std::vector<Tensor> project(const Tensor& x, int64_t pos0) const;
  int64_t n_head_, n_kv_head_, head_dim_;
  double rope_theta_;
  std::shared_ptr<Linear> qkv_proj_, o_proj_;
};

class LlamaMLP : public Module {
 public:
  LlamaMLP(int64_t d_model, int64_t hidden, Generator& gen);
  Tensor forward(const Tensor& x) const;  // down(swiglu(gate_up(x)))

 private:
  std::shared_ptr<Linear> gate_up_proj_, down_proj_;
};

class LlamaBlock : public DecoderBlock {
 public:
  LlamaBlock(const GPTConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) const override;
  Tensor forward_cached(const Tensor& x, LayerKV& kv) const override;

 private:
  std::shared_ptr<RMSNorm> input_layernorm_, post_attention_layernorm_;
  std::shared_ptr<LlamaAttention> self_attn_;
  std::shared_ptr<LlamaMLP> mlp_;
};

}  // namespace kuai::nn
