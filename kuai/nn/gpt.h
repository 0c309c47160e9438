// A GPT-2 style decoder: token + learned position embeddings, n_layer pre-LN blocks (causal
// self-attention, then a GELU MLP, each added to the residual stream), a final LayerNorm, and
// an output projection tied to the token embedding. Parameter names follow GPT-2's checkpoints
// ("wte.weight", "h.0.attn.c_attn.weight", ...), so weights map one to one.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kuai/nn/layers.h"

namespace kuai::nn {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t d_model = 256;
  int64_t seq_len = 256;  // longest sequence (rows of the position embedding)
};

// How attention is computed: naive (the (B, H, T, T) probabilities materialised and kept for the
// backward), flash (tiled, O(T) memory: FlashAttention), or auto: flash from kFlashAutoMinT
// positions on, where it measured faster on a 2-core AVX2 CPU (docs/flash_attention.md: kuai's
// naive attention is 10-50% faster up to T = 1024, flash 2-7% faster from 2048 on). Flash keeps
// 3-36x less memory at every T; choose it explicitly when memory is what limits.
enum class AttentionImpl { kNaive, kFlash, kAuto };
inline constexpr int64_t kFlashAutoMinT = 2048;
const char* attention_impl_name(AttentionImpl impl);          // "naive" | "flash" | "auto"
AttentionImpl parse_attention_impl(const std::string& name);  // throws naming the choices

// Keys and values of the positions seen so far, per layer, for incremental decoding: each new
// token attends to the cached keys instead of recomputing the whole prefix, so it costs O(T)
// rather than O(T^2).
struct LayerKV {
  Tensor k, v;  // (B, H, length, head_dim), contiguous
};
struct KVCache {
  std::vector<LayerKV> layers;
  int64_t length = 0;  // positions cached
};

class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(int64_t d_model, int64_t n_head, Generator& gen);
  Tensor forward(const Tensor& x) const;  // (B, T, C) -> (B, T, C)
  AttentionImpl impl() const { return impl_; }
  void set_impl(AttentionImpl impl) { impl_ = impl; }
  // x (B, t, C) at positions kv.length.. : either a prefill (empty cache, causal over the t
  // tokens) or one new token (t = 1, attends to every cached position). Appends to kv. Unless
  // the implementation is naive, both run the flash kernel (the new query rows against the
  // cached keys).
  Tensor forward_cached(const Tensor& x, LayerKV& kv) const;

 private:
  int64_t n_head_;
  AttentionImpl impl_ = AttentionImpl::kNaive;
  std::shared_ptr<Linear> c_attn_, c_proj_;
};

class MLP : public Module {
 public:
  MLP(int64_t d_model, Generator& gen);
  Tensor forward(const Tensor& x) const;

 private:
  std::shared_ptr<Linear> c_fc_, c_proj_;
};

class Block : public Module {
 public:
  Block(const GPTConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) const;
  Tensor forward_cached(const Tensor& x, LayerKV& kv) const;

 private:
  std::shared_ptr<LayerNorm> ln_1_, ln_2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<MLP> mlp_;
};

class GPT : public Module {
 public:
  // Parameters get GPT-2's initialisation from Philox(seed): N(0, 0.02) for embeddings and
  // linear weights, N(0, 0.02/sqrt(2 n_layer)) for the residual projections (c_proj), zero
  // biases, LayerNorms at identity.
  GPT(const GPTConfig& cfg, uint64_t seed);
  Tensor forward(const Tensor& idx) const;  // int32 (B, T) -> logits (B, T, vocab)
  // Mean cross-entropy of next-token targets (B, T); targets == ignore_index are skipped.
  Tensor loss(const Tensor& idx, const Tensor& targets, int32_t ignore_index = -1) const;
  const GPTConfig& config() const { return cfg_; }
  // Inference with a KV cache (no autograd): logits (B, t, vocab) of `idx` (B, t) at positions
  // cache.length .. cache.length + t - 1, given what the cache holds; the cache grows by t.
  // A prefill (empty cache) takes any t <= seq_len; afterwards one token at a time.
  Tensor forward_cached(const Tensor& idx, KVCache& cache) const;
  // Parameters without the token embedding and the positions (what "N" counts in 6·N·tokens
  // plus the tied output projection, which is a matmul).
  int64_t num_matmul_parameters() const;

 private:
  Tensor hidden(const Tensor& idx) const;  // (B, T, C) after ln_f
  GPTConfig cfg_;
  std::shared_ptr<Embedding> wte_, wpe_;
  std::vector<std::shared_ptr<Block>> h_;
  std::shared_ptr<LayerNorm> ln_f_;
};

}  // namespace kuai::nn
