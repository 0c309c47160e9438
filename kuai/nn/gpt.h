// The decoder-only language model, in two families chosen by GPTConfig::family:
//  - "gpt2": token + learned position embeddings, n_layer pre-LN blocks (causal self-attention,
//    then a GELU MLP, each added to the residual stream), a final LayerNorm, and an output
//    projection tied to the token embedding. Parameter names follow GPT-2's checkpoints
//    ("wte.weight", "h.0.attn.c_attn.weight", ...), so weights map one to one.
//  - "llama": LLaMA's blocks (kuai/nn/llama.h): RMSNorm, rotary positions, grouped-query
//    attention and a SwiGLU MLP, no biases, untied output projection by default.
// Both run through the same trainer, techniques, checkpoints and sampler.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kuai/core/backend.h"
#include "kuai/nn/checkpoint.h"
#include "kuai/nn/layers.h"
#include "kuai/nn/units.h"

namespace kuai::nn {

struct GPTConfig {
  std::string family = "gpt2";  // "gpt2" | "llama"
  int64_t vocab_size = 256;
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t d_model = 256;
  int64_t seq_len = 256;  // longest sequence (rows of the position embedding; RoPE's positions)
  // llama only (gpt2 has n_kv_head = n_head, an MLP of 4 d_model, tied embeddings):
  int64_t n_kv_head = 0;        // key/value heads of grouped-query attention; 0: n_head
  int64_t ffn_hidden = 0;       // SwiGLU width; 0: LLaMA's rule (llama_ffn_hidden)
  double rope_theta = 10000.0;  // base of the rotary frequencies
  double norm_eps = 1e-5;       // RMSNorm's epsilon (gpt2's LayerNorms use 1e-5)
  bool tie_embeddings = false;  // output projection = token embedding (always so for gpt2)

  bool is_llama() const { return family == "llama"; }
  int64_t kv_heads() const { return is_llama() && n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t ffn() const;
  bool tied() const { return !is_llama() || tie_embeddings; }
  // The config with every default made explicit (what a model keeps and an export records).
  GPTConfig resolved() const;
  // Throws std::invalid_argument naming the model.* key that is wrong.
  void validate() const;
  bool operator==(const GPTConfig&) const = default;
};

// LLaMA's MLP width for d_model C: int(2/3 * 4C) rounded up to a multiple of 256.
int64_t llama_ffn_hidden(int64_t d_model);

// "GPT-2, 4 layers, 4 heads, d_model 256" or "LLaMA, 4 layers, 4 heads (2 key/value), d_model
// 256, SwiGLU 768, untied": what a log line says about the model.
std::string describe(const GPTConfig& cfg);

// How attention is computed: naive (the (B, H, T, T) probabilities materialised and kept for the
// backward), flash (tiled, O(T) memory: FlashAttention), or auto: whichever of the two runs the
// model's attention shape faster on the device, forward and backward together, as the device's
// backend measured it (Backend::faster_attention: the CPU measures each shape once and keeps the
// answer in its tuning cache; with nothing measured, flash from 2048 positions). Flash keeps
// 3-36x less memory at every T; choose it explicitly when memory is what limits.
enum class AttentionImpl { kNaive, kFlash, kAuto };
const char* attention_impl_name(AttentionImpl impl);  // "naive" | "flash" | "auto"
// The causal self-attention of `cfg`'s blocks at this batch, in dtype `dtype`.
AttentionShape attention_shape(const GPTConfig& cfg, int64_t batch, DType dtype);
// Whether `impl` runs flash attention on `s` (auto: the kernel the backend of `device` finds
// faster; a meta device answers as the CPU).
bool runs_flash(AttentionImpl impl, const AttentionShape& s, Device device = kCPU);
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

// An attention module whose kernel kuai::optimize can switch (nn/optimize.h).
class AttentionModule : public Module {
 public:
  AttentionImpl impl() const { return impl_; }
  void set_impl(AttentionImpl impl) { impl_ = impl; }

 protected:
  // q (B, H, T, d) and k (B, Hkv, T, d) as the kernel will get them.
  bool use_flash(const Tensor& q, const Tensor& k) const;
  AttentionImpl impl_ = AttentionImpl::kNaive;
};

// One residual block of either family.
class DecoderBlock : public Module {
 public:
  virtual Tensor forward(const Tensor& x) const = 0;
  // x (B, t, C) at the positions after what kv holds (see CausalSelfAttention::forward_cached).
  virtual Tensor forward_cached(const Tensor& x, LayerKV& kv) const = 0;
};

class CausalSelfAttention : public AttentionModule {
 public:
  CausalSelfAttention(int64_t d_model, int64_t n_head, Generator& gen);
  Tensor forward(const Tensor& x) const;  // (B, T, C) -> (B, T, C)
  // x (B, t, C) at positions kv.length.. : either a prefill (empty cache, causal over the t
  // tokens) or one new token (t = 1, attends to every cached position). Appends to kv. Unless
  // the implementation is naive, both run the flash kernel (the new query rows against the
  // cached keys).
  Tensor forward_cached(const Tensor& x, LayerKV& kv) const;

 private:
  int64_t n_head_;
  std::shared_ptr<Linear> c_attn_, c_proj_;
};

class MLP : public Module {
 public:
  MLP(int64_t d_model, Generator& gen);
  Tensor forward(const Tensor& x) const;

 private:
  std::shared_ptr<Linear> c_fc_, c_proj_;
};

class Block : public DecoderBlock {
 public:
  Block(const GPTConfig& cfg, Generator& gen);
  Tensor forward(const Tensor& x) const override;
  Tensor forward_cached(const Tensor& x, LayerKV& kv) const override;

 private:
  std::shared_ptr<LayerNorm> ln_1_, ln_2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<MLP> mlp_;
};

class GPT : public Module {
 public:
  // gpt2: GPT-2's initialisation from Philox(seed): N(0, 0.02) for embeddings and linear
  // weights, N(0, 0.02/sqrt(2 n_layer)) for the residual projections (c_proj), zero biases,
  // LayerNorms at identity. llama: LLaMA's (Hugging Face's LlamaPreTrainedModel): N(0, 0.02) for
  // every linear weight and the embedding, RMSNorms at 1. The config is validated and kept
  // resolved (config() has every default explicit).
  GPT(const GPTConfig& cfg, uint64_t seed);
  Tensor forward(const Tensor& idx) const;  // int32 (B, T) -> logits (B, T, vocab)
  // Mean cross-entropy of next-token targets (B, T); targets == ignore_index are skipped.
  Tensor loss(const Tensor& idx, const Tensor& targets, int32_t ignore_index = -1) const;
  const GPTConfig& config() const { return cfg_; }
  // Inference with a KV cache (no autograd): logits (B, t, vocab) of `idx` (B, t) at positions
  // cache.length .. cache.length + t - 1, given what the cache holds; the cache grows by t.
  // A prefill (empty cache) takes any t <= seq_len; afterwards one token at a time.
  Tensor forward_cached(const Tensor& idx, KVCache& cache) const;
  // The parameters that multiply activations (what "N" counts in 6·N·tokens): all but the
  // position embedding and an untied token embedding (lookups); a tied one counts, as the
  // output projection.
  int64_t num_matmul_parameters() const;
  // Activation recomputation (nn/checkpoint.h) of the first `layers` blocks (-1: every block) in
  // training forwards; kNone: none.
  void set_recompute(Recompute policy, int64_t layers = -1);
  Recompute recompute() const { return recompute_; }
  int64_t recompute_layers() const;  // how many blocks recompute
  // ZeRO-3's units (nn/units.h): the embedding, each block, the head; every parameter in one.
  std::vector<ModelUnit> units() const;
  // The initial values of parameter `name` (what the constructor gave it from its seed) into the
  // contiguous fp32 tensor `dst` of its shape: one parameter made without the others, so that a
  // model built on meta (ZeRO-3) fills its shards without ever being whole. Throws on an unknown
  // name or a wrong shape.
  void initial_values(const std::string& name, const Tensor& dst) const;
  // Hooks called around each unit's forward (forward and forward_cached); null: none. The hooks
  // must outlive the model's forwards.
  void set_unit_hooks(UnitHooks* hooks) { unit_hooks_ = hooks; }
  UnitHooks* unit_hooks() const { return unit_hooks_; }

 private:
  Tensor embed(const Tensor& idx, int64_t start) const;  // (B, t, C) at positions start..
  Tensor head(const Tensor& x) const;                    // final norm, then logits
  GPTConfig cfg_;
  uint64_t seed_ = 0;
  std::shared_ptr<Embedding> wte_, wpe_;  // gpt2: wte, wpe; llama: embed_tokens
  std::vector<std::shared_ptr<DecoderBlock>> h_;
  std::shared_ptr<LayerNorm> ln_f_;  // gpt2
  std::shared_ptr<RMSNorm> norm_;    // llama
  std::shared_ptr<Linear> lm_head_;  // llama, untied: weight (vocab, C)
  Recompute recompute_ = Recompute::kNone;
  int64_t recompute_layers_ = -1;
  UnitHooks* unit_hooks_ = nullptr;
};

}  // namespace kuai::nn
