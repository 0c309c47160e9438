// Hugging Face LLaMA layout: name mapping, config.json, export and import (see hf_llama.h).
#include "kuai/io/hf_llama.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "kuai/core/device.h"
#include "kuai/core/ops.h"
#include "kuai/io/safetensors.h"
#include "kuai/io/tensor_io.h"
#include "kuai/io/text_file.h"

namespace kuai::io {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {}", where, what));
}

// One kuai parameter and the HF tensors it holds as consecutive row blocks.
struct Mapping {
  std::string kuai;
  std::vector<std::pair<std::string, int64_t>> hf;  // name, rows
  int64_t cols;
};

std::vector<Mapping> mappings(const nn::GPTConfig& c) {
  const int64_t C = c.d_model, hd = C / c.n_head, H = c.n_head, Hkv = c.kv_heads(), F = c.ffn();
  std::vector<Mapping> m;
  m.push_back({"embed_tokens.weight", {{"model.embed_tokens.weight", c.vocab_size}}, C});
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string k = fmt::format("layers.{}.", i), h = "model." + k;
    m.push_back({k + "input_layernorm.weight", {{h + "input_layernorm.weight", C}}, 1});
    m.push_back({k + "self_attn.qkv_proj.weight",
                 {{h + "self_attn.q_proj.weight", H * hd},
                  {h + "self_attn.k_proj.weight", Hkv * hd},
                  {h + "self_attn.v_proj.weight", Hkv * hd}},
                 C});
    m.push_back({k + "self_attn.o_proj.weight", {{h + "self_attn.o_proj.weight", C}}, H * hd});
    m.push_back(
        {k + "post_attention_layernorm.weight", {{h + "post_attention_layernorm.weight", C}}, 1});
    m.push_back({k + "mlp.gate_up_proj.weight",
                 {{h + "mlp.gate_proj.weight", F}, {h + "mlp.up_proj.weight", F}},
                 C});
    m.push_back({k + "mlp.down_proj.weight", {{h + "mlp.down_proj.weight", C}}, F});
  }
  m.push_back({"norm.weight", {{"model.norm.weight", C}}, 1});
  if (!c.tied()) m.push_back({"lm_head.weight", {{"lm_head.weight", c.vocab_size}}, C});
  return m;
}

// The HF shape of a block: norms are 1-D.
Shape hf_shape(const Mapping& m, int64_t rows) {
  return m.cols == 1 ? Shape{rows} : Shape{rows, m.cols};
}

void require_llama(const nn::GPTConfig& cfg, const char* what) {
  if (!cfg.is_llama())
    throw std::invalid_argument(
        fmt::format("{}: Hugging Face's LLaMA layout needs model.family = \"llama\", not \"{}\"",
                    what, cfg.family));
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> to_hf_tensors(
    const nn::GPTConfig& cfg, const std::vector<std::pair<std::string, Tensor>>& named) {
  require_llama(cfg, "to_hf_tensors");
  std::map<std::string, Tensor> by_name(named.begin(), named.end());
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Mapping& m : mappings(cfg)) {
    auto it = by_name.find(m.kuai);
    if (it == by_name.end()) continue;
    const Tensor& t = it->second;
    int64_t at = 0;
    for (const auto& [name, rows] : m.hf) {
      out.emplace_back(name, contiguous(narrow(t.detach(), 0, at, rows)));
      at += rows;
    }
  }
  return out;
}

std::map<std::string, Tensor> from_hf_tensors(const nn::GPTConfig& cfg,
                                              const std::map<std::string, Tensor>& hf,
                                              const std::string& source) {
  require_llama(cfg, "from_hf_tensors");
  std::set<std::string> used;
  std::map<std::string, Tensor> out;
  for (const Mapping& m : mappings(cfg)) {
    std::vector<Tensor> parts;
    for (const auto& [name, rows] : m.hf) {
      auto it = hf.find(name);
      if (it == hf.end()) fail(source, fmt::format("missing tensor \"{}\"", name));
      const Shape want = hf_shape(m, rows);
      if (it->second.shape() != want)
        fail(source, fmt::format("shape mismatch for \"{}\": file has {}, the config needs {}",
                                 name, shape_str(it->second.shape()), shape_str(want)));
      if (it->second.dtype() != DType::kF32)
        fail(source, fmt::format("tensor \"{}\" is {}, expected F32 here", name,
                                 dtype_name(it->second.dtype())));
      parts.push_back(it->second);
      used.insert(name);
    }
    out[m.kuai] = parts.size() == 1 ? parts[0] : cat(parts, 0);
  }
  for (const auto& [name, t] : hf) {
    if (used.count(name) || name.ends_with("rotary_emb.inv_freq")) continue;
    if (cfg.tied() && name == "lm_head.weight") continue;  // a tied copy some writers keep
    fail(source, fmt::format("unexpected tensor \"{}\": the config has no such weight", name));
  }
  return out;
}

std::string hf_config_json(const nn::GPTConfig& c, DType stored) {
  require_llama(c, "hf_config_json");
  Json j;  // sorted keys, as save_pretrained writes them
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.d_model;
  j["intermediate_size"] = c.ffn();
  j["num_attention_heads"] = c.n_head;
  j["num_key_value_heads"] = c.kv_heads();
  j["num_hidden_layers"] = c.n_layer;
  j["head_dim"] = c.d_model / c.n_head;
  j["max_position_embeddings"] = c.seq_len;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = nullptr;
  j["vocab_size"] = c.vocab_size;
  j["tie_word_embeddings"] = c.tied();
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["initializer_range"] = 0.02;
  j["pretraining_tp"] = 1;
  j["use_cache"] = true;
  j["torch_dtype"] = stored == DType::kBF16 ? "bfloat16" : "float32";
  return j.dump(2) + "\n";
}

nn::GPTConfig parse_hf_config(const std::string& text, const std::string& path) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, fmt::format("not valid JSON ({})", e.what()));
  }
  if (!j.is_object()) fail(path, "not a JSON object");
  auto field = [&](const char* key) -> const Json& {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) fail(path, fmt::format("missing \"{}\"", key));
    return *it;
  };
  auto integer = [&](const char* key) {
    const Json& v = field(key);
    if (!v.is_number_integer() || v.get<int64_t>() < 1)
      fail(path, fmt::format("\"{}\" is not a positive integer ({})", key, v.dump()));
    return v.get<int64_t>();
  };
  auto number = [&](const char* key, double fallback) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_number() || !(it->get<double>() > 0))
      fail(path, fmt::format("\"{}\" is not a positive number ({})", key, it->dump()));
    return it->get<double>();
  };
  auto flag = [&](const char* key, bool fallback) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) fail(path, fmt::format("\"{}\" is not true or false", key));
    return it->get<bool>();
  };
  const auto type = j.find("model_type");
  if (type != j.end() && (!type->is_string() || type->get<std::string>() != "llama"))
    fail(path, fmt::format("model_type is {}, expected \"llama\"", type->dump()));
  if (const auto act = j.find("hidden_act");
      act != j.end() && (!act->is_string() || act->get<std::string>() != "silu"))
    fail(path, fmt::format("hidden_act is {}; kuai's LLaMA MLP is SwiGLU (\"silu\")", act->dump()));
  if (const auto arch = j.find("architectures"); arch != j.end() && !arch->is_null()) {
    const bool llama =
        arch->is_array() && std::any_of(arch->begin(), arch->end(), [](const Json& a) {
          return a.is_string() && a.get<std::string>() == "LlamaForCausalLM";
        });
    if (!llama)
      fail(path, fmt::format("architectures {} has no \"LlamaForCausalLM\"", arch->dump()));
  }
  if (const auto f = j.find("partial_rotary_factor");
      f != j.end() && !f->is_null() && !(f->is_number() && f->get<double>() == 1.0))
    fail(path, fmt::format("partial_rotary_factor {} is not supported (every dimension rotates)",
                           f->dump()));
  // Newer writers keep the rotary settings in "rope_parameters" ({"rope_type", "rope_theta"}).
  std::optional<double> theta_in_parameters;
  if (const auto rp = j.find("rope_parameters"); rp != j.end() && !rp->is_null()) {
    if (!rp->is_object()) fail(path, "rope_parameters is not an object");
    if (const auto type = rp->find("rope_type");
        type != rp->end() && !(type->is_string() && type->get<std::string>() == "default"))
      fail(path, fmt::format("rope_parameters.rope_type {} is not supported (plain rotary "
                             "positions only: \"default\")",
                             type->dump()));
    for (const auto& [key, value] : rp->items())
      if (key != "rope_type" && key != "rope_theta")
        fail(path, fmt::format("rope_parameters.{} is not supported", key));
    if (const auto t = rp->find("rope_theta"); t != rp->end()) {
      if (!t->is_number() || !(t->get<double>() > 0))
        fail(path,
             fmt::format("rope_parameters.rope_theta is not a positive number ({})", t->dump()));
      theta_in_parameters = t->get<double>();
    }
  }
  if (const auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null())
    fail(path,
         fmt::format("rope_scaling {} is not supported (plain rotary positions only)", rs->dump()));
  if (flag("attention_bias", false) || flag("mlp_bias", false))
    fail(path, "biased projections (attention_bias / mlp_bias) are not supported");
  nn::GPTConfig c;
  c.family = "llama";
  c.vocab_size = integer("vocab_size");
  c.d_model = integer("hidden_size");
  c.n_layer = integer("num_hidden_layers");
  c.n_head = integer("num_attention_heads");
  c.n_kv_head = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                    ? integer("num_key_value_heads")
                    : c.n_head;
  c.ffn_hidden = integer("intermediate_size");
  c.seq_len = integer("max_position_embeddings");
  c.rope_theta = theta_in_parameters ? *theta_in_parameters : number("rope_theta", 10000.0);
  c.norm_eps = number("rms_norm_eps", 1e-6);
  c.tie_embeddings = flag("tie_word_embeddings", false);
  if (const auto hd = j.find("head_dim");
      hd != j.end() && !hd->is_null() &&
      (!hd->is_number_integer() || hd->get<int64_t>() * c.n_head != c.d_model))
    fail(path, fmt::format("head_dim {} is not hidden_size / num_attention_heads ({})", hd->dump(),
                           c.d_model / c.n_head));
  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    // kuai's key names; config.json's are hidden_size, num_attention_heads, ... (see above).
    fail(path, fmt::format("{} (as read from config.json)", e.what()));
  }
  return c.resolved();
}

void export_hf(const std::string& dir, const nn::GPT& model, DType stored) {
  export_hf(
      dir, model.config(),
      [&](const std::function<void(const std::string&, const Tensor&)>& fn) {
        for (const auto& [name, p] : model.named_parameters()) fn(name, p);
      },
      stored);
}

void export_hf(const std::string& dir, const nn::GPTConfig& cfg, const ParameterStream& params,
               DType stored, const std::string& tokenizer_json) {
  require_llama(cfg, "export_hf");
  if (stored != DType::kF32 && stored != DType::kBF16)
    throw std::invalid_argument("export_hf: stored dtype must be f32 or bf16");
  const std::string path = dir + "/model.safetensors";
  // The tensors the config has (a tied model has no lm_head), by their shapes on meta.
  std::set<std::string> present;
  {
    const DeviceGuard meta(kMeta);
    const nn::GPT shapes(cfg, 0);
    for (const auto& [name, p] : shapes.named_parameters()) present.insert(name);
  }
  // The file's layout up front, in HF's order (each fused weight's row blocks in turn); each
  // parameter's blocks are written as it comes, so one parameter at a time is held here.
  std::vector<SafetensorsView> views;
  std::map<std::string, std::pair<const Mapping*, size_t>> first_view;  // kuai name -> its blocks
  const std::vector<Mapping> maps = mappings(cfg);
  for (const Mapping& m : maps) {
    if (!present.count(m.kuai)) continue;
    first_view[m.kuai] = {&m, views.size()};
    for (const auto& [name, rows] : m.hf) {
      const Shape shape = hf_shape(m, rows);
      views.push_back({name, safetensors_dtype(stored), shape, nullptr,
                       static_cast<uint64_t>(rows * m.cols * dtype_size(stored))});
    }
  }
  std::filesystem::create_directories(dir);
  // An older config.json goes first and the new one comes last, so a failure in between leaves
  // weights without a config (refused by read_hf), never a config describing other weights.
  // An older tokenizer.json goes too: it may be another model's.
  std::filesystem::remove(dir + "/config.json");
  std::filesystem::remove(dir + "/tokenizer.json");
  SafetensorsWriter file(path, views, {{"format", "pt"}});
  std::set<std::string> done;
  params([&](const std::string& name, const Tensor& t) {
    const auto it = first_view.find(name);
    if (it == first_view.end())
      fail(path, fmt::format("parameter \"{}\" is not a weight of this config", name));
    if (!done.insert(name).second)
      fail(path, fmt::format("parameter \"{}\" was given twice", name));
    const auto [m, v0] = it->second;
    int64_t at = 0;
    size_t v = v0;
    for (const auto& [hf_name, rows] : m->hf) {
      const Tensor block = contiguous(cast(narrow(t.detach(), 0, at, rows), stored));
      if (block.shape() != views[v].shape)
        fail(path, fmt::format("\"{}\" has shape {}, expected {}", hf_name,
                               shape_str(block.shape()), shape_str(views[v].shape)));
      std::vector<std::byte> bytes(static_cast<size_t>(block.nbytes()));
      if (!bytes.empty()) block.copy_to_host(bytes.data(), bytes.size());
      file.write(v, 0, bytes.data(), bytes.size());
      at += rows;
      ++v;
    }
  });
  for (const auto& [name, unused] : first_view)
    if (!done.count(name)) fail(path, fmt::format("parameter \"{}\" was never given", name));
  file.finish();
  if (!tokenizer_json.empty()) write_text_atomically(dir + "/tokenizer.json", tokenizer_json);
  write_text_atomically(dir + "/config.json", hf_config_json(cfg, stored));
}

struct HfReader::Source {
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> where;  // HF tensor name -> the file holding it
  std::vector<Mapping> mappings;
  const SafetensorsEntry& entry(const std::string& name) const {
    return *files[where.at(name)].find(name);
  }
};

HfReader::HfReader(const std::string& dir) : dir_(dir) {
  const std::string config_path = dir + "/config.json";
  std::ifstream f(config_path, std::ios::binary);
  if (!f) fail(config_path, "cannot open");
  std::stringstream text;
  text << f.rdbuf();
  config_ = parse_hf_config(text.str(), config_path);
  auto src = std::make_shared<Source>();
  // One file, or the shards an index names (save_pretrained splits large models).
  weights_ = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (!std::filesystem::exists(weights_) && std::filesystem::exists(index_path)) {
    weights_ = index_path;
    std::ifstream in(index_path, std::ios::binary);
    Json index;
    try {
      index = Json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      fail(index_path, fmt::format("not valid JSON ({})", e.what()));
    }
    const auto map = index.find("weight_map");
    if (!index.is_object() || map == index.end() || !map->is_object())
      fail(index_path, "has no \"weight_map\" object");
    std::set<std::string> shards;
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        fail(index_path, fmt::format("\"{}\" maps to {}, not a file name", name, file.dump()));
      shards.insert(file.get<std::string>());
    }
    for (const std::string& shard : shards) {
      src->files.push_back(SafetensorsFile::open(dir + "/" + shard));
      for (const SafetensorsEntry& e : src->files.back().entries()) {
        const auto it = map->find(e.name);
        if (it == map->end() || it->get<std::string>() != shard)
          fail(dir + "/" + shard,
               fmt::format("tensor \"{}\" is not mapped to this shard by {}", e.name, index_path));
        src->where.emplace(e.name, src->files.size() - 1);
      }
    }
  } else {
    src->files.push_back(SafetensorsFile::open(weights_));
    for (const SafetensorsEntry& e : src->files.back().entries()) src->where.emplace(e.name, 0);
  }
  // Every header checked before any parameter is made.
  for (const auto& [name, file] : src->where) {
    const std::string& dtype = src->entry(name).dtype;
    if (dtype != "F32" && dtype != "BF16" && dtype != "F16")
      fail(src->files[file].path(),
           fmt::format("tensor \"{}\" is {}; expected F32, BF16 or F16", name,
                       dtype_name(dtype_from_safetensors(src->files[file].path(), name, dtype))));
  }
  src->mappings = mappings(config_);
  std::set<std::string> used;
  for (const Mapping& m : src->mappings)
    for (const auto& [name, rows] : m.hf) {
      const auto it = src->where.find(name);
      if (it == src->where.end()) fail(weights_, fmt::format("missing tensor \"{}\"", name));
      const Shape want = hf_shape(m, rows);
      const SafetensorsEntry& e = src->entry(name);
      const Shape have(e.shape.begin(), e.shape.end());
      if (have != want)
        fail(weights_, fmt::format("shape mismatch for \"{}\": file has {}, the config needs {}",
                                   name, shape_str(have), shape_str(want)));
      used.insert(name);
    }
  for (const auto& [name, file] : src->where) {
    if (used.count(name) || name.ends_with("rotary_emb.inv_freq")) continue;
    if (config_.tied() && name == "lm_head.weight") continue;  // a tied copy some writers keep
    fail(weights_, fmt::format("unexpected tensor \"{}\": the config has no such weight", name));
  }
  source_ = std::move(src);
}

void HfReader::check_describes(const nn::GPTConfig& want) const {
  std::vector<std::string> diffs;
  auto field = [&](const char* hf_key, const auto& have, const auto& need) {
    if (have != need) diffs.push_back(fmt::format("{} {} (the model has {})", hf_key, have, need));
  };
  field("hidden_size", config_.d_model, want.d_model);
  field("num_hidden_layers", config_.n_layer, want.n_layer);
  field("num_attention_heads", config_.n_head, want.n_head);
  // Resolved: a model config leaves these 0 for their defaults (n_head, LLaMA's 8/3 d rounded).
  field("num_key_value_heads", config_.kv_heads(), want.kv_heads());
  field("intermediate_size", config_.ffn(), want.ffn());
  field("vocab_size", config_.vocab_size, want.vocab_size);
  field("rope_theta", config_.rope_theta, want.rope_theta);
  field("rms_norm_eps", config_.norm_eps, want.norm_eps);
  field("tie_word_embeddings", config_.tie_embeddings, want.tie_embeddings);
  // Rotary positions have no table: a model may train on windows shorter than
  // max_position_embeddings, never longer.
  if (config_.seq_len < want.seq_len)
    diffs.push_back(fmt::format("max_position_embeddings {} (the model's seq_len {} is longer)",
                                config_.seq_len, want.seq_len));
  if (!diffs.empty())
    fail(dir_, fmt::format("config.json describes another model: {}", fmt::join(diffs, "; ")));
}

std::vector<std::string> HfReader::names() const {
  std::vector<std::string> out;
  for (const Mapping& m : source_->mappings) out.push_back(m.kuai);
  return out;
}

Tensor HfReader::parameter(const std::string& name) const {
  const Mapping* m = nullptr;
  for (const Mapping& x : source_->mappings)
    if (x.kuai == name) m = &x;
  if (m == nullptr) fail(weights_, fmt::format("the config has no parameter \"{}\"", name));
  std::vector<Tensor> parts;
  for (const auto& [hf_name, rows] : m->hf) {
    const Tensor t = read_tensor(source_->files[source_->where.at(hf_name)], hf_name);
    parts.push_back(t.dtype() == DType::kF32 ? t : cast(t, DType::kF32));
  }
  return parts.size() == 1 ? parts[0] : cat(parts, 0);
}

HfCheckpoint read_hf(const std::string& dir) {
  const HfReader reader(dir);
  HfCheckpoint out;
  out.config = reader.config();
  for (const std::string& name : reader.names()) out.state[name] = reader.parameter(name);
  return out;
}

void load_hf(const std::string& dir, nn::GPT& model) {
  const HfReader reader(dir);
  reader.check_describes(model.config());
  std::map<std::string, Tensor> state;
  for (const std::string& name : reader.names()) state[name] = reader.parameter(name);
  model.load_state_dict(state);
}

}  // namespace kuai::io
