// Weights-only export and strict loading (see export.h). Loading checks, in this order: the
// metadata (format, version, model, step, tokenizer, dtype), the model config against the
// target model, the set of tensor names against the model's parameters, then per tensor its
// dtype, shape and checksum; only then are the parameters overwritten.
#include "kuai/io/export.h"

#include <fmt/format.h>

#include <charconv>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "kuai/core/device.h"
#include "kuai/core/primitives.h"
#include "kuai/core/version.h"
#include "kuai/io/checksum.h"
#include "kuai/io/safetensors.h"
#include "kuai/io/tensor_io.h"

namespace kuai::io {
namespace {

using Json = nlohmann::json;  // std::map objects: lookups stay O(log n) in a hostile file
using OrderedJson = nlohmann::ordered_json;  // only for the five model fields, in order

constexpr char kFormatKey[] = "kuai.format";
constexpr char kVersionKey[] = "kuai.version";
constexpr char kModelKey[] = "kuai.model";
constexpr char kStepKey[] = "kuai.step";
constexpr char kTokenizerKey[] = "kuai.tokenizer";
constexpr char kDtypeKey[] = "kuai.dtype";
constexpr char kChecksumsKey[] = "kuai.checksums";
constexpr char kWeightsFormat[] = "weights";

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error(fmt::format("{}: {}", path, what));
}

std::string export_dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    default:
      return std::string(dtype_name(t));
  }
}

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// The model config's fields, in the order they are written and compared.
std::vector<std::pair<const char*, int64_t nn::GPTConfig::*>> config_fields() {
  return {{"vocab_size", &nn::GPTConfig::vocab_size},
          {"n_layer", &nn::GPTConfig::n_layer},
          {"n_head", &nn::GPTConfig::n_head},
          {"d_model", &nn::GPTConfig::d_model},
          {"seq_len", &nn::GPTConfig::seq_len}};
}

std::vector<std::pair<const char*, int64_t nn::GPTConfig::*>> llama_int_fields() {
  return {{"n_kv_head", &nn::GPTConfig::n_kv_head}, {"ffn_hidden", &nn::GPTConfig::ffn_hidden}};
}
std::vector<std::pair<const char*, double nn::GPTConfig::*>> llama_float_fields() {
  return {{"rope_theta", &nn::GPTConfig::rope_theta}, {"norm_eps", &nn::GPTConfig::norm_eps}};
}

// The model's JSON: gpt2 keeps the five fields it always had; llama adds its own.
OrderedJson model_json(const nn::GPTConfig& c) {
  OrderedJson j = OrderedJson::object();
  if (c.is_llama()) j["family"] = c.family;
  for (const auto& [field, member] : config_fields()) j[field] = c.*member;
  if (!c.is_llama()) return j;
  for (const auto& [field, member] : llama_int_fields()) j[field] = c.*member;
  for (const auto& [field, member] : llama_float_fields()) j[field] = c.*member;
  j["tie_embeddings"] = c.tie_embeddings;
  return j;
}

const std::string& required(const std::string& path, const SafetensorsFile& file, const char* key) {
  auto it = file.metadata().find(key);
  if (it == file.metadata().end()) fail(path, fmt::format("missing metadata \"{}\"", key));
  if (it->second.empty()) fail(path, fmt::format("metadata \"{}\" is empty", key));
  return it->second;
}

Json parse_json_object(const std::string& path, const char* key, const std::string& text) {
  Json value;
  try {
    value = Json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, fmt::format("metadata \"{}\" is not valid JSON ({})", key, e.what()));
  }
  if (!value.is_object()) fail(path, fmt::format("metadata \"{}\" is not a JSON object", key));
  return value;
}

nn::GPTConfig parse_model(const std::string& path, const std::string& text) {
  const Json value = parse_json_object(path, kModelKey, text);
  nn::GPTConfig cfg;
  std::set<std::string> known;
  for (const auto& [name, member] : config_fields()) {
    known.insert(name);
    auto it = value.find(name);
    if (it == value.end())
      fail(path, fmt::format("metadata \"{}\" has no \"{}\"", kModelKey, name));
    if (!it->is_number_integer() || it->get<int64_t>() < 1 ||
        (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      fail(path, fmt::format("metadata \"{}\": \"{}\" is not a positive integer ({})", kModelKey,
                             name, it->dump()));
    }
    cfg.*member = it->get<int64_t>();
  }
  // The llama family's fields (absent from gpt2 exports, which keep the five above).
  known.insert("family");
  if (auto it = value.find("family"); it != value.end()) {
    if (!it->is_string())
      fail(path, fmt::format("metadata \"{}\": \"family\" is not a string", kModelKey));
    cfg.family = it->get<std::string>();
  }
  for (const auto& [name, member] : llama_int_fields()) {
    known.insert(name);
    auto it = value.find(name);
    if (it == value.end()) continue;
    if (!it->is_number_integer() || it->get<int64_t>() < 1)
      fail(path, fmt::format("metadata \"{}\": \"{}\" is not a positive integer ({})", kModelKey,
                             name, it->dump()));
    cfg.*member = it->get<int64_t>();
  }
  for (const auto& [name, member] : llama_float_fields()) {
    known.insert(name);
    auto it = value.find(name);
    if (it == value.end()) continue;
    if (!it->is_number() || !(it->get<double>() > 0))
      fail(path, fmt::format("metadata \"{}\": \"{}\" is not a positive number ({})", kModelKey,
                             name, it->dump()));
    cfg.*member = it->get<double>();
  }
  known.insert("tie_embeddings");
  if (auto it = value.find("tie_embeddings"); it != value.end()) {
    if (!it->is_boolean())
      fail(path,
           fmt::format("metadata \"{}\": \"tie_embeddings\" is not true or false", kModelKey));
    cfg.tie_embeddings = it->get<bool>();
  }
  for (const auto& [name, item] : value.items()) {
    if (!known.count(name)) {
      fail(path, fmt::format("metadata \"{}\" has unknown field \"{}\"", kModelKey, name));
    }
  }
  try {
    cfg.validate();
  } catch (const std::invalid_argument& e) {
    fail(path, fmt::format("metadata \"{}\": {}", kModelKey, e.what()));
  }
  return cfg.resolved();
}

WeightsInfo parse_info(const SafetensorsFile& file) {
  const std::string& path = file.path();
  auto format = file.metadata().find(kFormatKey);
  if (format == file.metadata().end()) {
    fail(path, fmt::format("not a kuai weights export: missing metadata \"{}\"", kFormatKey));
  }
  if (format->second != kWeightsFormat) {
    fail(path, fmt::format("not a kuai weights export: \"{}\" is \"{}\", expected \"{}\"",
                           kFormatKey, format->second, kWeightsFormat));
  }
  WeightsInfo info;
  info.version = required(path, file, kVersionKey);
  info.model = parse_model(path, required(path, file, kModelKey));

  const std::string& step = required(path, file, kStepKey);
  const auto [end, error] = std::from_chars(step.data(), step.data() + step.size(), info.step);
  if (error != std::errc() || end != step.data() + step.size() || info.step < 0) {
    fail(path,
         fmt::format("metadata \"{}\" = \"{}\" is not a non-negative integer", kStepKey, step));
  }
  info.tokenizer = required(path, file, kTokenizerKey);

  const std::string& dtype = required(path, file, kDtypeKey);
  if (dtype == "f32") {
    info.dtype = DType::kF32;
  } else if (dtype == "bf16") {
    info.dtype = DType::kBF16;
  } else {
    fail(path,
         fmt::format("metadata \"{}\" = \"{}\" is not one of \"f32\", \"bf16\"", kDtypeKey, dtype));
  }
  return info;
}

}  // namespace

ExportStats export_weights(const std::string& path, const nn::GPT& model,
                           const ExportOptions& options) {
  if (options.dtype != DType::kF32 && options.dtype != DType::kBF16) {
    fail(path, fmt::format("cannot export as {}: the export dtype is f32 or bf16",
                           dtype_name(options.dtype)));
  }
  if (options.step < 0) fail(path, fmt::format("cannot export a negative step {}", options.step));
  if (options.tokenizer.empty()) fail(path, "cannot export with an empty tokenizer name");

  const auto params = model.named_parameters();
  const int64_t es = dtype_size(options.dtype);
  auto stored_bytes = [&](size_t i) { return static_cast<size_t>(params[i].second.numel() * es); };
  std::map<const TensorImpl*, size_t> working_copies;  // filled from their masters, below
  std::map<const TensorImpl*, size_t> sharded;         // filled from the ranks' shards
  std::vector<size_t> whole;                           // held here, whole
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, param] = params[i];
    if (param.device() != kCPU) {
      fail(path, fmt::format("parameter \"{}\" is on {}; export reads CPU tensors", name,
                             param.device().str()));
    }
    if (param.has_storage() && param.storage()->released) {
      if (!options.sharded)
        fail(path, fmt::format("parameter \"{}\" is sharded across the ranks (ZeRO-3) and no "
                               "reader of its shards was given",
                               name));
      sharded[param.impl()] = i;
    } else if (param.impl()->master_elsewhere) {
      if (!options.masters)
        fail(path, fmt::format("parameter \"{}\" is a {} working copy whose fp32 master is "
                               "elsewhere, and no reader of the masters was given",
                               name, dtype_name(param.dtype())));
      working_copies[param.impl()] = i;
    } else {
      whole.push_back(i);
    }
  }

  // The file is streamed: its header first, with placeholders of the checksums' width (they are
  // known once each tensor's bytes are), then each tensor as it becomes whole, then the header
  // again with the checksums. At most the tensors still being assembled are held here.
  std::vector<SafetensorsView> views;
  const std::string placeholder(xxh3_hex(nullptr, 0).size(), '0');
  Json checksums = Json::object();
  for (size_t i = 0; i < params.size(); ++i) {
    views.push_back({params[i].first, safetensors_dtype(options.dtype), params[i].second.shape(),
                     nullptr, static_cast<uint64_t>(stored_bytes(i))});
    checksums[params[i].first] = placeholder;
  }
  auto metadata = [&]() -> std::map<std::string, std::string> {
    return {
        {kFormatKey, kWeightsFormat},
        {kVersionKey, kKuaiVersion},
        {kModelKey, model_json(model.config()).dump()},
        {kStepKey, std::to_string(options.step)},
        {kTokenizerKey, options.tokenizer},
        {kDtypeKey, export_dtype_name(options.dtype)},
        {kChecksumsKey, checksums.dump()},
    };
  };
  SafetensorsWriter file(path, views, metadata());
  ExportStats stats;
  int64_t held = 0;
  auto put = [&](size_t i, const std::vector<std::byte>& bytes) {
    if (!bytes.empty()) file.write(i, 0, bytes.data(), bytes.size());
    checksums[params[i].first] = xxh3_hex(bytes.data(), bytes.size());
  };
  for (size_t i : whole) {
    std::vector<std::byte> bytes(stored_bytes(i));
    stats.max_held_bytes = std::max<int64_t>(stats.max_held_bytes, int64_t(bytes.size()));
    const Tensor c = params[i].second.detach().to(options.dtype).contiguous();  // the Cast op
    if (c.numel() > 0) c.copy_to_host(bytes.data(), bytes.size());
    put(i, bytes);
  }
  // Working copies: their fp32 masters, cast piece by piece into the stored bytes as they stream
  // (no whole fp32 copy is held), each element exactly once. Sharded parameters the same way,
  // from the reader that gathers them. A parameter is written once all its pieces are in.
  for (const auto& [pieces, reader, what] :
       {std::tuple{&working_copies, &options.masters, "masters"},
        std::tuple{&sharded, &options.sharded, "shards"}}) {
    if (pieces->empty()) continue;
    std::vector<int64_t> covered(params.size(), 0);
    std::map<size_t, std::vector<std::byte>> open;  // parameters being assembled
    (*reader)([&, pieces = pieces, what = what](const Tensor& p, int64_t begin, int64_t count,
                                                const float* values) {
      auto it = pieces->find(p.impl());
      if (it == pieces->end() || begin < 0 || count < 0 || begin + count > p.numel())
        fail(path, fmt::format("the {}' reader gave elements [{}, {}) of {}, not a piece of "
                               "a parameter it covers",
                               what, begin, begin + count, p.str()));
      const size_t i = it->second;
      auto [at, fresh] = open.try_emplace(i);
      if (fresh) {
        at->second.resize(stored_bytes(i));
        held += static_cast<int64_t>(stored_bytes(i));
        stats.max_held_bytes = std::max(stats.max_held_bytes, held);
      }
      const Tensor src = Tensor::borrow(const_cast<float*>(values), {count}, DType::kF32);
      std::vector<Tensor> dst = {
          Tensor::borrow(at->second.data() + begin * es, {count}, options.dtype)};
      Cast(options.dtype).eval_cpu(std::span<const Tensor>(&src, 1), dst);
      covered[i] += count;
      if (covered[i] > params[i].second.numel())
        fail(path, fmt::format("the {} of \"{}\" gave {} elements, more than its {}", what,
                               params[i].first, covered[i], params[i].second.numel()));
      if (covered[i] == params[i].second.numel()) {
        put(i, at->second);
        held -= static_cast<int64_t>(stored_bytes(i));
        open.erase(at);
      }
    });
    for (const auto& [impl, i] : *pieces)
      if (covered[i] != params[i].second.numel())
        fail(path, fmt::format("the {} of \"{}\" gave {} of its {} elements", what, params[i].first,
                               covered[i], params[i].second.numel()));
  }
  file.set_metadata(metadata());
  file.finish();  // fsync, rename into place
  return stats;
}

WeightsInfo read_weights_info(const std::string& path) {
  return parse_info(SafetensorsFile::open(path));
}

namespace {

// Every parameter of `model` (its names and shapes; a meta model will do) from the export `file`,
// checked (config, names, dtype, shape, checksum) and widened to the parameter's dtype, one at a
// time: fn(name, value). Every check of a tensor runs before fn sees it.
void for_each_weight(const std::string& path, const SafetensorsFile& file, const WeightsInfo& info,
                     const nn::GPT& model,
                     const std::function<void(const std::string&, const Tensor&)>& fn) {
  if (!(info.model == model.config())) {
    const OrderedJson file_json = model_json(info.model), model_fields = model_json(model.config());
    std::vector<std::string> mismatches;
    for (const auto& [field, v] : model_fields.items()) {
      const auto it = file_json.find(field);
      const std::string have = it == file_json.end() ? "none" : it->dump();
      if (have != v.dump())
        mismatches.push_back(fmt::format("file has {} {}, model {}", field, have, v.dump()));
    }
    for (const auto& [field, v] : file_json.items())
      if (!model_fields.contains(field))
        mismatches.push_back(fmt::format("file has {} {}, model none", field, v.dump()));
    fail(path, fmt::format("config mismatch: {}", fmt::join(mismatches, "; ")));
  }

  const Json checksums =
      parse_json_object(path, kChecksumsKey, required(path, file, kChecksumsKey));
  const auto params = model.named_parameters();
  std::set<std::string> names;
  for (const auto& [name, param] : params) names.insert(name);
  for (const SafetensorsEntry& entry : file.entries()) {
    if (!names.count(entry.name)) {
      fail(path,
           fmt::format("unexpected tensor \"{}\": the model has no such parameter", entry.name));
    }
  }
  for (const auto& [name, value] : checksums.items()) {
    if (!names.count(name)) {
      fail(path, fmt::format("metadata \"{}\" lists unknown tensor \"{}\"", kChecksumsKey, name));
    }
  }

  const std::string stored_dtype = safetensors_dtype(info.dtype);
  for (const auto& [name, param] : params) {
    const SafetensorsEntry* entry = file.find(name);
    if (entry == nullptr) fail(path, fmt::format("missing tensor \"{}\"", name));
    if (entry->dtype != stored_dtype) {
      fail(path, fmt::format("tensor \"{}\" is {} but \"{}\" says {}", name, entry->dtype,
                             kDtypeKey, export_dtype_name(info.dtype)));
    }
    if (entry->shape != param.shape()) {
      fail(path, fmt::format("shape mismatch for \"{}\": file has {}, model {}", name,
                             shape_text(entry->shape), shape_text(param.shape())));
    }
    const auto bytes = file.data(*entry);
    auto expected = checksums.find(name);
    if (expected == checksums.end() || !expected->is_string()) {
      fail(path, fmt::format("metadata \"{}\" has no checksum for \"{}\"", kChecksumsKey, name));
    }
    const std::string actual = xxh3_hex(bytes.data(), bytes.size());
    if (actual != expected->get<std::string>()) {
      fail(path, fmt::format("checksum mismatch for {} (metadata says {}, data hashes to {})", name,
                             expected->get<std::string>(), actual));
    }
    // Copy out of the mapping first: the data section has no alignment guarantee.
    Tensor stored = Tensor::empty(entry->shape, info.dtype, kCPU);
    if (!bytes.empty()) stored.copy_from_host(bytes.data(), bytes.size());
    fn(name, stored.to(param.dtype()));  // the Cast op where the dtypes differ
  }
}

}  // namespace

void load_weights(const std::string& path, nn::GPT& model) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  const WeightsInfo info = parse_info(file);
  std::map<std::string, Tensor> state;  // verified values, in the parameters' dtypes
  for_each_weight(path, file, info, model, [&](const std::string& name, const Tensor& value) {
    state.emplace(name, value);
  });
  try {
    model.load_state_dict(state);
  } catch (const std::exception& e) {
    fail(path, e.what());
  }
}

WeightsInfo read_weights_stream(
    const std::string& path,
    const std::function<void(const std::string& name, const Tensor& value)>& fn) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  const WeightsInfo info = parse_info(file);
  std::unique_ptr<nn::GPT> shapes;
  {
    const DeviceGuard meta(kMeta);  // names and shapes, no bytes
    shapes = std::make_unique<nn::GPT>(info.model, 0);
  }
  for_each_weight(path, file, info, *shapes, fn);
  return info;
}

}  // namespace kuai::io
