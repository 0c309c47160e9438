// GPTConfig's rules (see gpt.h): the llama family's defaults, validation naming the model.* key,
// and the log line. Its own file, with no dependency beyond fmt, so the config fuzzer links it.
#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "kuai/nn/gpt.h"

namespace kuai::nn {

int64_t llama_ffn_hidden(int64_t d_model) {
  const int64_t h = 2 * 4 * d_model / 3;  // int(2 * 4C / 3)
  return (h + 255) / 256 * 256;
}

int64_t GPTConfig::ffn() const {
  if (!is_llama()) return 4 * d_model;
  return ffn_hidden > 0 ? ffn_hidden : llama_ffn_hidden(d_model);
}

std::string describe(const GPTConfig& c) {
  if (!c.is_llama())
    return fmt::format("GPT-2, {} layers, {} heads, d_model {}", c.n_layer, c.n_head, c.d_model);
  return fmt::format("LLaMA, {} layers, {} heads ({} key/value), d_model {}, SwiGLU {}, {}",
                     c.n_layer, c.n_head, c.kv_heads(), c.d_model, c.ffn(),
                     c.tied() ? "tied" : "untied");
}

GPTConfig GPTConfig::resolved() const {
  GPTConfig c = *this;
  c.n_kv_head = kv_heads();
  c.ffn_hidden = ffn();
  c.tie_embeddings = tied();
  return c;
}

void GPTConfig::validate() const {
  auto bad = [](const std::string& what) { throw std::invalid_argument("model." + what); };
  if (family != "gpt2" && family != "llama")
    bad(fmt::format("family = \"{}\" is not one of \"gpt2\", \"llama\"", family));
  if (vocab_size <= 0 || n_layer <= 0 || d_model <= 0 || seq_len <= 0 || n_head <= 0)
    bad("vocab_size, n_layer, n_head, d_model and seq_len must be positive");
  if (d_model % n_head != 0)
    bad(fmt::format("d_model ({}) must be divisible by model.n_head ({})", d_model, n_head));
  if (!is_llama()) {
    if (n_kv_head != 0 && n_kv_head != n_head)
      bad(fmt::format("n_kv_head = {} needs family \"llama\" (gpt2 has one per head)", n_kv_head));
    if (ffn_hidden != 0 && ffn_hidden != 4 * d_model)
      bad(fmt::format("ffn_hidden = {} needs family \"llama\" (gpt2's MLP is 4 d_model)",
                      ffn_hidden));
    return;
  }
  if (n_kv_head < 0 || n_head % kv_heads() != 0)
    bad(fmt::format("n_kv_head ({}) must divide model.n_head ({})", n_kv_head, n_head));
  if ((d_model / n_head) % 2 != 0)
    bad(fmt::format("d_model / n_head ({}) must be even for rotary positions", d_model / n_head));
  if (ffn_hidden < 0)
    bad(fmt::format("ffn_hidden ({}) must be positive, or 0 for the rule", ffn_hidden));
  if (!(rope_theta > 0)) bad(fmt::format("rope_theta ({}) must be positive", rope_theta));
  if (!(norm_eps > 0)) bad(fmt::format("norm_eps ({}) must be positive", norm_eps));
}

}  // namespace kuai::nn
