// The GPT model (see gpt.h).
#include "kuai/nn/gpt.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "kuai/core/autograd.h"
#include "kuai/core/backend.h"
#include "kuai/core/ops.h"
#include "kuai/nn/llama.h"

namespace kuai::nn {

const char* attention_impl_name(AttentionImpl impl) {
  switch (impl) {
    case AttentionImpl::kNaive:
      return "naive";
    case AttentionImpl::kFlash:
      return "flash";
    case AttentionImpl::kAuto:
      return "auto";
  }
  return "?";
}

AttentionImpl parse_attention_impl(const std::string& name) {
  for (AttentionImpl i : {AttentionImpl::kNaive, AttentionImpl::kFlash, AttentionImpl::kAuto})
    if (name == attention_impl_name(i)) return i;
  throw std::invalid_argument("attention: unknown implementation '" + name +
                              "' (one of \"naive\", \"flash\", \"auto\")");
}

AttentionShape attention_shape(const GPTConfig& cfg, int64_t batch, DType dtype) {
  AttentionShape s;
  s.batch = batch;
  s.heads = cfg.n_head;
  s.kv_heads = cfg.kv_heads();
  s.seq = cfg.seq_len;
  s.head_dim = cfg.d_model / cfg.n_head;
  s.dtype = dtype;
  s.causal = true;
  return s;
}

bool runs_flash(AttentionImpl impl, const AttentionShape& s, Device device) {
  if (impl != AttentionImpl::kAuto) return impl == AttentionImpl::kFlash;
  return backend_for(device).faster_attention(s) == AttentionKernel::kFlash;
}

bool AttentionModule::use_flash(const Tensor& q, const Tensor& k) const {
  if (impl_ != AttentionImpl::kAuto) return impl_ == AttentionImpl::kFlash;
  AttentionShape s;
  s.batch = q.size(0);
  s.heads = q.size(1);
  s.kv_heads = k.size(1);
  s.seq = q.size(2);
  s.head_dim = q.size(3);
  s.dtype = q.dtype();
  return runs_flash(impl_, s, q.device());
}

CausalSelfAttention::CausalSelfAttention(int64_t d_model, int64_t n_head, Generator& gen)
    : n_head_(n_head) {
  if (n_head <= 0 || d_model % n_head != 0)
    throw std::invalid_argument(
        fmt::format("attention: d_model {} is not divisible by n_head {}", d_model, n_head));
  c_attn_ = register_module("c_attn", std::make_shared<Linear>(d_model, 3 * d_model, true, gen));
  c_proj_ = register_module("c_proj", std::make_shared<Linear>(d_model, d_model, true, gen));
}

Tensor CausalSelfAttention::forward(const Tensor& x) const {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), H = n_head_, hd = C / H;
  std::vector<Tensor> qkv = chunk(c_attn_->forward(x), 3, -1);  // 3 x (B, T, C) views
  auto heads = [&](const Tensor& t) { return transpose(reshape(t, {B, T, H, hd}), 1, 2); };
  // (B, H, T, hd): flash keeps one fp32 lse per row for the backward, naive the probabilities.
  const Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  Tensor y = use_flash(q, k) ? flash_attention(q, k, v, /*causal=*/true)
                             : scaled_dot_product_attention(q, k, v, /*causal=*/true);
  y = reshape(transpose(y, 1, 2), {B, T, C});  // a view: y is (B, T, H, hd)
  return c_proj_->forward(y);
}

Tensor CausalSelfAttention::forward_cached(const Tensor& x, LayerKV& kv) const {
  const int64_t B = x.size(0), t = x.size(1), C = x.size(2), H = n_head_, hd = C / H;
  const bool prefill = !kv.k.defined();
  if (!prefill && t != 1)
    throw std::invalid_argument(
        fmt::format("attention: a filled KV cache takes one token at a time, got {}", t));
  std::vector<Tensor> qkv = chunk(c_attn_->forward(x), 3, -1);
  auto heads = [&](const Tensor& u) { return transpose(reshape(u, {B, t, H, hd}), 1, 2); };
  const Tensor q = heads(qkv[0]), k = contiguous(heads(qkv[1])), v = contiguous(heads(qkv[2]));
  kv.k = prefill ? k : cat({kv.k, k}, 2);  // (B, H, length + t, hd)
  kv.v = prefill ? v : cat({kv.v, v}, 2);
  Tensor y;                            // (B, H, t, hd)
  if (impl_ != AttentionImpl::kNaive)  // query i at position length + i: causal either way
    y = flash_attention(q, kv.k, kv.v, /*causal=*/true);
  else
    y = prefill ? scaled_dot_product_attention(q, kv.k, kv.v, /*causal=*/true)
                : attention_composite(q, kv.k, kv.v, /*causal=*/false);
  return c_proj_->forward(reshape(transpose(y, 1, 2), {B, t, C}));
}

MLP::MLP(int64_t d_model, Generator& gen) {
  c_fc_ = register_module("c_fc", std::make_shared<Linear>(d_model, 4 * d_model, true, gen));
  c_proj_ = register_module("c_proj", std::make_shared<Linear>(4 * d_model, d_model, true, gen));
}

Tensor MLP::forward(const Tensor& x) const { return c_proj_->forward(gelu(c_fc_->forward(x))); }

Block::Block(const GPTConfig& cfg, Generator& gen) {
  ln_1_ = register_module("ln_1", std::make_shared<LayerNorm>(cfg.d_model));
  attn_ =
      register_module("attn", std::make_shared<CausalSelfAttention>(cfg.d_model, cfg.n_head, gen));
  ln_2_ = register_module("ln_2", std::make_shared<LayerNorm>(cfg.d_model));
  mlp_ = register_module("mlp", std::make_shared<MLP>(cfg.d_model, gen));
}

Tensor Block::forward(const Tensor& x) const {
  Tensor h = add(x, attn_->forward(ln_1_->forward(x)));
  return add(h, mlp_->forward(ln_2_->forward(h)));
}

Tensor Block::forward_cached(const Tensor& x, LayerKV& kv) const {
  Tensor h = add(x, attn_->forward_cached(ln_1_->forward(x), kv));
  return add(h, mlp_->forward(ln_2_->forward(h)));
}

namespace {
GPTConfig validated(const GPTConfig& c) {
  c.validate();  // before resolving, which would fill in what is checked
  return c.resolved();
}
}  // namespace

GPT::GPT(const GPTConfig& config, uint64_t seed) : cfg_(validated(config)), seed_(seed) {
  const GPTConfig& cfg = cfg_;
  Generator gen(seed, /*stream=*/0);
  if (!cfg.is_llama()) {
    wte_ = register_module("wte", std::make_shared<Embedding>(cfg.vocab_size, cfg.d_model, gen));
    wpe_ = register_module("wpe", std::make_shared<Embedding>(cfg.seq_len, cfg.d_model, gen));
    for (int64_t i = 0; i < cfg.n_layer; ++i)
      h_.push_back(register_module("h." + std::to_string(i), std::make_shared<Block>(cfg, gen)));
    ln_f_ = register_module("ln_f", std::make_shared<LayerNorm>(cfg.d_model));
  } else {
    wte_ = register_module("embed_tokens",
                           std::make_shared<Embedding>(cfg.vocab_size, cfg.d_model, gen));
    for (int64_t i = 0; i < cfg.n_layer; ++i)
      h_.push_back(
          register_module("layers." + std::to_string(i), std::make_shared<LlamaBlock>(cfg, gen)));
    norm_ = register_module(
        "norm", std::make_shared<RMSNorm>(cfg.d_model, static_cast<float>(cfg.norm_eps)));
    if (!cfg.tied())
      lm_head_ = register_module("lm_head",
                                 std::make_shared<Linear>(cfg.d_model, cfg.vocab_size, false, gen));
  }

  // The family's initialisation, in parameter order from one stream (initial_values makes the
  // same values one parameter at a time).
  Generator init(seed, /*stream=*/1);
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg.n_layer));
  for (auto& [name, p] : named_parameters()) {
    if (p.dim() == 1) {  // LayerNorm / RMSNorm weights stay 1, biases become 0
      if (name.ends_with(".bias")) fill_(p, 0.0f);
      continue;
    }
    const float std = !cfg.is_llama() && name.ends_with("c_proj.weight") ? proj_std : 0.02f;
    init.normal_(p, 0.0f, std);
  }
}

void GPT::initial_values(const std::string& name, const Tensor& dst) const {
  Generator init(seed_, /*stream=*/1);
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg_.n_layer));
  for (const auto& [n, p] : named_parameters()) {
    if (n != name) {  // the stream moves past it as the constructor's did
      if (p.dim() != 1) init.set_offset(init.offset() + static_cast<uint64_t>((p.numel() + 3) / 4));
      continue;
    }
    if (dst.shape() != p.shape() || dst.dtype() != DType::kF32 || !dst.is_contiguous())
      throw std::invalid_argument(
          fmt::format("GPT::initial_values: {} needs a contiguous float32 "
                      "{}, got {}",
                      name, shape_str(p.shape()), dst.str()));
    const autograd::NoGradGuard no_grad;
    if (p.dim() == 1) {
      fill_(dst, name.ends_with(".bias") ? 0.0f : 1.0f);
      return;
    }
    const float std = !cfg_.is_llama() && name.ends_with("c_proj.weight") ? proj_std : 0.02f;
    init.normal_(dst, 0.0f, std);
    return;
  }
  throw std::invalid_argument("GPT::initial_values: no parameter named " + name);
}

Tensor GPT::embed(const Tensor& idx, int64_t start) const {
  const int64_t t = idx.size(1);
  if (cfg_.is_llama()) return wte_->forward(idx);  // positions enter as rotations
  // (B, t, C) + (t, C)
  return add(wte_->forward(idx), start == 0 ? wpe_->forward(arange(t, DType::kI32, idx.device()))
                                            : narrow(wpe_->weight(), 0, start, t));
}

Tensor GPT::head(const Tensor& x) const {
  if (!cfg_.is_llama()) return linear(ln_f_->forward(x), wte_->weight());
  return cfg_.tied() ? linear(norm_->forward(x), wte_->weight())
                     : lm_head_->forward(norm_->forward(x));
}

Tensor GPT::forward(const Tensor& idx) const {
  if (idx.dim() != 2 || idx.dtype() != DType::kI32)
    throw std::invalid_argument("GPT: expected int32 token ids (B, T), got " + idx.str());
  const int64_t T = idx.size(1);
  if (T > cfg_.seq_len)
    throw std::invalid_argument(
        fmt::format("GPT: sequence length {} exceeds model.seq_len {}", T, cfg_.seq_len));
  Tensor x;
  {
    const UnitScope unit(unit_hooks_, 0);
    x = embed(idx, 0);
  }
  const int64_t recomputed = recompute_layers();
  for (size_t i = 0; i < h_.size(); ++i) {
    const UnitScope unit(unit_hooks_, i + 1);
    const DecoderBlock& block = *h_[i];
    x = static_cast<int64_t>(i) < recomputed
            ? checkpoint([&block](const Tensor& in) { return block.forward(in); }, x, recompute_)
            : block.forward(x);
  }
  const UnitScope unit(unit_hooks_, h_.size() + 1);
  return head(x);
}

std::vector<ModelUnit> GPT::units() const {
  std::vector<ModelUnit> u;
  u.push_back({"embed", wte_->parameters(), {}});
  if (wpe_)
    for (const Tensor& p : wpe_->parameters()) u.back().params.push_back(p);
  const std::string block = cfg_.is_llama() ? "layers." : "h.";
  for (size_t i = 0; i < h_.size(); ++i)
    u.push_back({block + std::to_string(i), h_[i]->parameters(), {}});
  u.push_back({"head", cfg_.is_llama() ? norm_->parameters() : ln_f_->parameters(), {}});
  if (lm_head_)
    for (const Tensor& p : lm_head_->parameters()) u.back().params.push_back(p);
  if (cfg_.tied()) u.back().uses.push_back(0);
  return u;
}

Tensor GPT::loss(const Tensor& idx, const Tensor& targets, int32_t ignore_index) const {
  Tensor logits = forward(idx);
  return cross_entropy(reshape(logits, {-1, cfg_.vocab_size}), reshape(targets, {-1}),
                       ignore_index);
}

Tensor GPT::forward_cached(const Tensor& idx, KVCache& cache) const {
  if (idx.dim() != 2 || idx.dtype() != DType::kI32)
    throw std::invalid_argument("GPT: expected int32 token ids (B, t), got " + idx.str());
  const int64_t t = idx.size(1), start = cache.length;
  if (start + t > cfg_.seq_len)
    throw std::invalid_argument(
        fmt::format("GPT: KV cache holds {} positions; {} more exceed model.seq_len {}", start, t,
                    cfg_.seq_len));
  autograd::NoGradGuard no_grad;
  if (cache.layers.empty()) cache.layers.resize(h_.size());
  Tensor x;
  {
    const UnitScope unit(unit_hooks_, 0);
    x = embed(idx, start);  // (B, t, C)
  }
  for (size_t i = 0; i < h_.size(); ++i) {
    const UnitScope unit(unit_hooks_, i + 1);
    x = h_[i]->forward_cached(x, cache.layers[i]);
  }
  cache.length += t;
  const UnitScope unit(unit_hooks_, h_.size() + 1);
  return head(x);
}

void GPT::set_recompute(Recompute policy, int64_t layers) {
  if (layers < -1)
    throw std::invalid_argument(
        fmt::format("recompute_layers must be -1 (every block) or at least 0, got {}", layers));
  recompute_ = policy;
  recompute_layers_ = layers;
}

int64_t GPT::recompute_layers() const {
  if (recompute_ == Recompute::kNone) return 0;
  const auto n = static_cast<int64_t>(h_.size());
  return recompute_layers_ < 0 ? n : std::min(recompute_layers_, n);
}

int64_t GPT::num_matmul_parameters() const {
  const int64_t lookups = cfg_.is_llama() ? (cfg_.tied() ? 0 : cfg_.vocab_size * cfg_.d_model)
                                          : cfg_.seq_len * cfg_.d_model;
  return num_parameters() - lookups;
}

}  // namespace kuai::nn
