// Config loading and validation (see config.h). One table of keys drives parsing, overrides,
// type checks and the "did you mean" suggestion.
#include "kuai/train/config.h"

#include <fmt/format.h>

#include <toml++/toml.h>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <variant>

#include "kuai/compile/pass_options.h"

namespace kuai::train {
namespace {

enum class Kind { kInt, kFloat, kString, kBool };

struct Key {
  const char* name;
  Kind kind;
  std::function<void(TrainConfig&, const toml::node&)> set;  // validates too
  std::function<std::string(const TrainConfig&)> get;        // TOML literal
};

[[noreturn]] void fail(const std::string& key, const std::string& what) {
  throw ConfigError(fmt::format("config: {} {}", key, what));
}

int64_t as_int(const std::string& key, const toml::node& n, int64_t lo, int64_t hi) {
  // The type first: toml++ converts a float node to an integer by a cast, undefined for a value
  // out of int64's range (the config fuzzer found `d_model = 1666666666666666666666666666.5`).
  if (!n.is_integer()) fail(key, fmt::format("must be an integer in [{}, {}]", lo, hi));
  auto v = n.value<int64_t>();
  if (!v) fail(key, fmt::format("must be an integer in [{}, {}]", lo, hi));
  if (*v < lo || *v > hi) fail(key, fmt::format("= {} is out of range [{}, {}]", *v, lo, hi));
  return *v;
}

double as_float(const std::string& key, const toml::node& n, double lo, double hi) {
  if (!(n.is_floating_point() || n.is_integer()))
    fail(key, fmt::format("must be a number in [{}, {}]", lo, hi));
  auto v = n.value<double>();
  if (!v) fail(key, fmt::format("must be a number in [{}, {}]", lo, hi));
  if (!(*v >= lo && *v <= hi)) fail(key, fmt::format("= {} is out of range [{}, {}]", *v, lo, hi));
  return *v;
}

bool as_bool(const std::string& key, const toml::node& n) {
  auto v = n.value<bool>();
  if (!n.is_boolean() || !v) fail(key, "must be true or false");
  return *v;
}

std::string as_string(const std::string& key, const toml::node& n,
                      const std::vector<std::string>& allowed) {
  auto v = n.value<std::string>();
  if (!n.is_string() || !v) fail(key, "must be a string");
  if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), *v) == allowed.end()) {
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + ("\"" + a + "\"");
    fail(key, fmt::format("= \"{}\" is not one of {}", *v, list));
  }
  return *v;
}

// A TOML basic string: "..." with every character that needs it escaped (control characters
// as \uXXXX), so any value round-trips (toml++'s printer can emit an invalid '''...''' form).
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == '"' || ch == '\\')
      out += {'\\', ch};
    else if (ch == '\n')
      out += "\\n";
    else if (ch == '\t')
      out += "\\t";
    else if (c < 0x20 || c == 0x7f)
      out += fmt::format("\\u{:04X}", c);
    else
      out += ch;
  }
  return out + "\"";
}

constexpr int64_t kBig = int64_t{1} << 40;

#define INT_KEY(NAME, FIELD, LO, HI)                                                    \
  Key {                                                                                 \
    NAME, Kind::kInt,                                                                   \
        [](TrainConfig& c, const toml::node& n) { c.FIELD = as_int(NAME, n, LO, HI); }, \
        [](const TrainConfig& c) { return std::to_string(c.FIELD); }                    \
  }
#define FLOAT_KEY(NAME, FIELD, LO, HI)                                                    \
  Key {                                                                                   \
    NAME, Kind::kFloat,                                                                   \
        [](TrainConfig& c, const toml::node& n) { c.FIELD = as_float(NAME, n, LO, HI); }, \
        [](const TrainConfig& c) { return fmt::format("{}", c.FIELD); }                   \
  }

#define BOOL_KEY(NAME, FIELD)                                                                   \
  Key {                                                                                         \
    NAME, Kind::kBool, [](TrainConfig& c, const toml::node& n) { c.FIELD = as_bool(NAME, n); }, \
        [](const TrainConfig& c) { return std::string(c.FIELD ? "true" : "false"); }            \
  }
#define STRING_KEY(NAME, FIELD, ...)                                                            \
  Key {                                                                                         \
    NAME, Kind::kString,                                                                        \
        [](TrainConfig& c, const toml::node& n) { c.FIELD = as_string(NAME, n, __VA_ARGS__); }, \
        [](const TrainConfig& c) { return quoted(c.FIELD); }                                    \
  }

const std::vector<Key>& keys() {
  static const std::vector<Key> k = {
      STRING_KEY("run.name", run_name, {}),
      STRING_KEY("run.dir", run_dir, {}),
      STRING_KEY("model.family", model.family, {"gpt2", "llama"}),
      INT_KEY("model.vocab_size", model.vocab_size, 1, int64_t{1} << 31),
      INT_KEY("model.n_layer", model.n_layer, 1, 1024),
      INT_KEY("model.n_head", model.n_head, 1, 1024),
      INT_KEY("model.d_model", model.d_model, 1, 1 << 16),
      INT_KEY("model.seq_len", model.seq_len, 1, 1 << 20),
      INT_KEY("model.n_kv_head", model.n_kv_head, 0, 1024),
      INT_KEY("model.ffn_hidden", model.ffn_hidden, 0, 1 << 20),
      FLOAT_KEY("model.rope_theta", model.rope_theta, 1.0, 1e12),
      FLOAT_KEY("model.norm_eps", model.norm_eps, 1e-12, 1.0),
      BOOL_KEY("model.tie_embeddings", model.tie_embeddings),
      STRING_KEY("model.attention", attention, {"naive", "flash", "auto"}),
      STRING_KEY("model.init_hf", init_hf, {}),
      INT_KEY("train.batch_size", batch_size, 1, 1 << 20),
      INT_KEY("train.steps", steps, 0, kBig),
      FLOAT_KEY("train.lr", lr, 0.0, 10.0),
      FLOAT_KEY("train.min_lr_ratio", min_lr_ratio, 0.0, 1.0),
      INT_KEY("train.warmup_steps", warmup_steps, 0, kBig),
      FLOAT_KEY("train.weight_decay", weight_decay, 0.0, 10.0),
      FLOAT_KEY("train.beta1", beta1, 0.0, 0.999999),
      FLOAT_KEY("train.beta2", beta2, 0.0, 0.999999),
      FLOAT_KEY("train.grad_clip", grad_clip, 0.0, 1e9),
      INT_KEY("train.seed", seed, 0, kBig),
      INT_KEY("train.threads", threads, 0, 1024),
      INT_KEY("train.log_every", log_every, 1, kBig),
      INT_KEY("train.accum_steps", accum_steps, 1, 1 << 20),
      STRING_KEY("train.precision", precision, {"fp32", "bf16", "fp16"}),
      BOOL_KEY("train.compile", compile),
      STRING_KEY("train.compile_memory", compile_memory, {"arena", "separate"}),
      STRING_KEY("train.compile_disable", compile_disable, {}),
      STRING_KEY("train.recompute", recompute, {"none", "selective", "full"}),
      INT_KEY("train.recompute_layers", recompute_layers, -1, 1 << 20),
      STRING_KEY("train.offload", offload, {"none", "disk"}),
      STRING_KEY("train.offload_dir", offload_dir, {}),
      INT_KEY("train.offload_chunk_mb", offload_chunk_mb, 1, 4096),
      BOOL_KEY("train.offload_master", offload_master),
      FLOAT_KEY("train.loss_scale", loss_scale, 1.1754943508222875e-38, 3.0e38),
      INT_KEY("train.loss_scale_growth_interval", loss_scale_growth_interval, 1, kBig),
      INT_KEY("train.eval_every", eval_every, 0, kBig),
      INT_KEY("train.eval_batches", eval_batches, 1, 1 << 20),
      STRING_KEY("data.source", data_source, {"file", "synthetic"}),
      STRING_KEY("data.path", data_path, {}),
      FLOAT_KEY("data.val_fraction", val_fraction, 0.0, 0.5),
      INT_KEY("data.workers", workers, 0, 64),
      INT_KEY("data.prefetch_factor", prefetch_factor, 1, 64),
      FLOAT_KEY("data.delay_ms", delay_ms, 0.0, 1e6),
      STRING_KEY("log.progress", progress, {"auto", "bar", "plain", "off"}),
      BOOL_KEY("log.jsonl", jsonl),
      BOOL_KEY("log.tensorboard", tensorboard),
      BOOL_KEY("log.sync_every_step", sync_every_step),
      BOOL_KEY("log.save_weights", save_weights),
      INT_KEY("checkpoint.save_every", save_every, 0, kBig),
      INT_KEY("checkpoint.export_every", export_every, 0, kBig),
      INT_KEY("checkpoint.keep_last", keep_last, 1, 1 << 20),
      BOOL_KEY("checkpoint.async", async_save),
      STRING_KEY("checkpoint.export_dtype", export_dtype, {"f32", "bf16"}),
      STRING_KEY("checkpoint.on_error", on_save_error, {"stop", "continue"}),
      FLOAT_KEY("dist.bucket_mb", bucket_mb, 0.001, 1e6),
      FLOAT_KEY("dist.first_bucket_mb", first_bucket_mb, 0.001, 1e6),
      BOOL_KEY("dist.overlap", overlap),
      BOOL_KEY("dist.find_unused", find_unused),
      STRING_KEY("dist.compression", compression, {"none", "fp16", "bf16"}),
      BOOL_KEY("dist.error_feedback", error_feedback),
      INT_KEY("dist.zero", zero, 0, 3),
      BOOL_KEY("dist.reshard_after_forward", reshard_after_forward),
      INT_KEY("dist.prefetch", prefetch, 0, 64),
      BOOL_KEY("dist.accumulate_sharded", accumulate_sharded),
      STRING_KEY("dist.gather_dtype", gather_dtype, {"fp32", "bf16", "fp16"}),
      FLOAT_KEY("dist.timeout_s", timeout_s, 0.1, 1e7),
  };
  return k;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

const Key& find_key(const std::string& name) {
  const Key* best = nullptr;
  size_t best_d = ~size_t{0};
  for (const Key& k : keys()) {
    if (name == k.name) return k;
    const size_t d = edit_distance(name, k.name);
    if (d < best_d) {
      best_d = d;
      best = &k;
    }
  }
  throw ConfigError(fmt::format("config: unknown key '{}' (did you mean '{}'?)", name, best->name));
}

void apply_table(TrainConfig& cfg, const toml::table& t, const std::string& prefix) {
  for (const auto& [k, node] : t) {
    const std::string name =
        prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = node.as_table()) {
      if (!prefix.empty()) find_key(name);  // nested tables deeper than section.key are unknown
      apply_table(cfg, *sub, name);
      continue;
    }
    find_key(name).set(cfg, node);
  }
}

void validate(const TrainConfig& c) {
  if (c.model.d_model % c.model.n_head != 0)
    throw ConfigError(
        fmt::format("config: model.d_model ({}) must be divisible by model.n_head ({})",
                    c.model.d_model, c.model.n_head));
  try {
    c.model.validate();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("config: {}", e.what()));
  }
  if (!c.init_hf.empty() && !c.model.is_llama())
    throw ConfigError(fmt::format(
        "config: model.init_hf = \"{}\" needs model.family = \"llama\" (Hugging Face's LLaMA "
        "layout)",
        c.init_hf));
  if (c.run_name.find('/') != std::string::npos || c.run_name == "." || c.run_name == "..")
    throw ConfigError(
        fmt::format("config: run.name = \"{}\" must be a plain name (no '/')", c.run_name));
  if (c.data_source == "file" && c.data_path.empty())
    throw ConfigError("config: data.path is empty (a token file; see `kuai prepare`)");
  if (c.data_source == "file" && c.model.vocab_size < 256)
    throw ConfigError(
        fmt::format("config: model.vocab_size ({}) must be at least 256 for byte-level token files",
                    c.model.vocab_size));
  try {
    (void)compiler::PassOptions::all_but(c.compile_disable);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(
        fmt::format("config: train.compile_disable = \"{}\": {}", c.compile_disable, e.what()));
  }
  if (c.offload_master && c.offload != "disk")
    throw ConfigError(fmt::format(
        "config: train.offload_master = true needs train.offload = \"disk\" (it is \"{}\")",
        c.offload));
  if (c.offload_master && c.precision == "fp32")
    throw ConfigError(
        "config: train.offload_master = true needs train.precision = \"bf16\" or \"fp16\": in "
        "fp32 the parameters are the master weights, there is no second copy to move");
  if (c.zero == 3) {
    // What ZeRO-3 does not combine with yet, each named (distributed/zero3.h).
    if (c.offload_master)
      throw ConfigError(
          "config: train.offload_master = true is not combined with dist.zero = 3 (its fp32 "
          "masters are the parameter shard)");
  }
  if (c.gather_dtype != "fp32" && (c.zero != 3 || c.gather_dtype != c.precision))
    throw ConfigError(fmt::format(
        "config: dist.gather_dtype = \"{}\" gathers ZeRO-3's parameters in the compute dtype: it "
        "needs dist.zero = 3 and train.precision = \"{}\" (got dist.zero = {}, train.precision "
        "= \"{}\")",
        c.gather_dtype, c.gather_dtype, c.zero, c.precision));
}

}  // namespace

namespace {

void apply_overrides(TrainConfig& cfg, const std::vector<std::string>& overrides) {
  for (std::string o : overrides) {
    if (o.rfind("--", 0) == 0) o = o.substr(2);
    const size_t eq = o.find('=');
    if (eq == std::string::npos)
      throw ConfigError(
          fmt::format("config: override '{}' is not of the form --section.key=value", o));
    const std::string name = o.substr(0, eq), value = o.substr(eq + 1);
    const Key& key = find_key(name);
    // Parse the value as a TOML literal; bare words are strings.
    toml::table parsed;
    try {
      parsed = toml::parse("v = " + value);
    } catch (const toml::parse_error&) {
      parsed = toml::table{{"v", value}};  // a bare word: a string, which typed keys reject
    }
    const toml::node* n = parsed.get("v");
    if (!n || (key.kind == Kind::kString && !n->is_string())) parsed = toml::table{{"v", value}};
    key.set(cfg, *parsed.get("v"));
  }
}

TrainConfig finish(TrainConfig cfg, const std::vector<std::string>& overrides) {
  apply_overrides(cfg, overrides);
  if (cfg.run_name.empty()) cfg.run_name = "run";
  validate(cfg);
  return cfg;
}

toml::table parse_toml(std::string_view text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("config: {}:{}:{}: {}", source, e.source().begin.line,
                                  e.source().begin.column, e.description()));
  }
}

}  // namespace

TrainConfig load_config_text(std::string_view toml_text, const std::string& source,
                             const std::vector<std::string>& overrides) {
  TrainConfig cfg;
  apply_table(cfg, parse_toml(toml_text, source), "");
  return finish(std::move(cfg), overrides);
}

TrainConfig load_config(const std::string& toml_path, const std::vector<std::string>& overrides) {
  TrainConfig cfg;
  if (!toml_path.empty()) {
    if (!std::filesystem::is_regular_file(toml_path))
      throw ConfigError(fmt::format("config: {}: no such file", toml_path));
    std::ifstream in(toml_path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    if (!in && !in.eof()) throw ConfigError(fmt::format("config: {}: cannot read", toml_path));
    apply_table(cfg, parse_toml(text.str(), toml_path), "");
    if (cfg.run_name.empty()) cfg.run_name = std::filesystem::path(toml_path).stem().string();
  }
  return finish(std::move(cfg), overrides);
}

std::string to_toml(const TrainConfig& cfg) {
  std::ostringstream out;
  std::string section;
  for (const Key& k : keys()) {
    const std::string name = k.name;
    const std::string sec = name.substr(0, name.find('.'));
    if (sec != section) {
      out << (section.empty() ? "" : "\n") << "[" << sec << "]\n";
      section = sec;
    }
    out << name.substr(name.find('.') + 1) << " = " << k.get(cfg) << "\n";
  }
  return out.str();
}

}  // namespace kuai::train
