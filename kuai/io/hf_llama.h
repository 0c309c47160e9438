// Interchange with Hugging Face's LLaMA layout (technique 9's export half, for the llama family):
// a directory holding model.safetensors with HF's tensor names and shapes
//   model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
//   model.layers.N.mlp.{gate,up,down}_proj.weight, model.layers.N.input_layernorm.weight,
//   model.layers.N.post_attention_layernorm.weight, model.norm.weight, lm_head.weight
// and config.json in HF's LlamaConfig schema (hidden_size, intermediate_size,
// num_attention_heads, num_key_value_heads, num_hidden_layers, rms_norm_eps, rope_theta,
// vocab_size, max_position_embeddings, tie_word_embeddings, ...), so that a model trained here
// opens in the tools that read that layout, and a HF LLaMA of a size that fits loads here for
// fine-tuning or sampling. kuai keeps q, k, v (and gate, up) as one fused weight each
// (nn/llama.h); HF's tensors are its row blocks, split on export and joined on import. Rotary
// positions use HF's rotate-half layout on both sides, so no permutation of q and k is needed.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kuai/core/tensor.h"
#include "kuai/nn/gpt.h"

namespace kuai::io {

// kuai's llama tensors (parameters, or anything named like them: gradients) under HF's names,
// the fused projections split into their row blocks (copies), in HF's order.
std::vector<std::pair<std::string, Tensor>> to_hf_tensors(
    const nn::GPTConfig& cfg, const std::vector<std::pair<std::string, Tensor>>& named);

// The inverse: HF-named fp32 tensors -> kuai's names, fused. Every tensor the config needs must be
// present with its shape and nothing else may be (lm_head.weight is optional when tied, and
// rotary caches such as "...rotary_emb.inv_freq" are ignored); errors name `source` and the tensor.
std::map<std::string, Tensor> from_hf_tensors(const nn::GPTConfig& cfg,
                                              const std::map<std::string, Tensor>& hf,
                                              const std::string& source);

// config.json text for cfg (family llama) in HF's schema; torch_dtype names the stored dtype.
std::string hf_config_json(const nn::GPTConfig& cfg, DType stored);
// A llama GPTConfig from HF's config.json text (`path` names it in errors): model_type "llama"
// and architectures with LlamaForCausalLM where present, hidden_act "silu", plain rotary
// positions (no rope_scaling, rope_parameters of type "default", every dimension rotated), no
// biases. rope_theta is read from rope_parameters where newer writers keep it.
nn::GPTConfig parse_hf_config(const std::string& text, const std::string& path);

// Writes dir/model.safetensors and dir/config.json (each atomically, config.json last and an older
// one removed first; dir is created). `stored` is F32 or BF16. With tokenizer_json (the text of a
// tokenizer.json, data/hf_tokenizer.h) dir/tokenizer.json too, before config.json; an older one is
// removed either way.
void export_hf(const std::string& dir, const nn::GPT& model, DType stored = DType::kF32);
// The same from a stream of the model's parameters under kuai's names (each once, fp32 or any
// dtype, in any order): each is split and written as it comes, so at most one parameter is held
// here, and a model read from its files (io::read_weights_stream, a checkpoint's shards) is
// exported without ever being whole in memory. The file is byte for byte the one above.
using ParameterStream =
    std::function<void(const std::function<void(const std::string& name, const Tensor& t)>&)>;
void export_hf(const std::string& dir, const nn::GPTConfig& cfg, const ParameterStream& params,
               DType stored = DType::kF32, const std::string& tokenizer_json = "");

// A Hugging Face LLaMA directory read one of kuai's parameters at a time. The constructor reads
// config.json and maps the weight file (or the shards model.safetensors.index.json names), and
// checks every header: each tensor the config needs is there with its shape, in F32, BF16 or
// F16, and nothing else is (a rotary cache, and lm_head.weight when tied, are ignored); errors
// name the file and the tensor. parameter() then makes one parameter, its row blocks widened to
// fp32 and joined from the mapped bytes: at most one parameter is held here. What ZeRO-3 fills
// its shards from (model.init_hf), so fine-tuning never holds the whole model either.
class HfReader {
 public:
  explicit HfReader(const std::string& dir);
  const nn::GPTConfig& config() const { return config_; }
  // Throws naming the directory and every field where config.json describes another model than
  // `model` (a seq_len up to its max_position_embeddings: rotary positions have no table).
  void check_describes(const nn::GPTConfig& model) const;
  // Every parameter's kuai name, in the order of Hugging Face's layout.
  std::vector<std::string> names() const;
  // One parameter under kuai's name, fp32, contiguous, on the CPU.
  Tensor parameter(const std::string& name) const;

 private:
  struct Source;
  std::string dir_, weights_;  // weights_: the file, or the index, that errors name
  nn::GPTConfig config_;
  std::shared_ptr<const Source> source_;
};

struct HfCheckpoint {
  nn::GPTConfig config;                 // resolved
  std::map<std::string, Tensor> state;  // kuai's names, fp32
};
// Reads and checks dir/config.json and dir/model.safetensors, or the shards
// dir/model.safetensors.index.json names (F32, BF16 or F16 tensors, widened).
HfCheckpoint read_hf(const std::string& dir);
// read_hf, then config.json must describe model.config() (a seq_len up to its
// max_position_embeddings: rotary positions have no table); every field that differs is named.
// The model is left as it was on any error.
void load_hf(const std::string& dir, nn::GPT& model);

}  // namespace kuai::io
