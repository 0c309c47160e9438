// Sampling with a KV cache (see generate.h).
#include "kuai/nn/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "kuai/core/ops.h"
#include "kuai/core/rng.h"

namespace kuai::nn {

int32_t sample_token(const float* logits, int64_t vocab, float temperature, int64_t top_k,
                     float u) {
  if (vocab <= 0) throw std::invalid_argument("sample_token: empty vocabulary");
  if (temperature <= 0.0f)
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  const int64_t k = top_k > 0 ? std::min(top_k, vocab) : vocab;
  // The k largest logits, largest first (ties: lower index first, so the draw is reproducible).
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[order[0]];
  double total = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    p[i] = std::exp((static_cast<double>(logits[order[i]]) - top) / temperature);
    total += p[i];
  }
  double target = static_cast<double>(u) * total, acc = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    acc += p[i];
    if (target < acc) return order[i];
  }
  return order[k - 1];
}

std::vector<int32_t> generate(const GPT& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& opt,
                              const std::function<void(int32_t)>& on_token) {
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt is empty");
  const int64_t V = model.config().vocab_size, T = model.config().seq_len;
  for (int32_t id : prompt)
    if (id < 0 || id >= V)
      throw std::invalid_argument("generate: prompt token " + std::to_string(id) +
                                  " is outside the vocabulary of " + std::to_string(V));
  Generator gen(opt.seed, /*stream=*/3);
  std::vector<int32_t> context = prompt, out;
  KVCache cache;
  Tensor logits;  // (1, t, V): the last row predicts the next token
  auto prefill = [&] {
    cache = KVCache{};
    const int64_t keep = std::min<int64_t>(static_cast<int64_t>(context.size()),
                                           out.empty() ? T : std::max<int64_t>(1, T / 2));
    std::vector<int32_t> tail(context.end() - keep, context.end());
    logits = model.forward_cached(from_vector(tail, {1, keep}), cache);
  };
  prefill();
  for (int64_t n = 0; n < opt.max_new_tokens; ++n) {
    const Tensor last = contiguous(narrow(logits, 1, logits.size(1) - 1, 1));
    float u = 0.0f;
    gen.uniform(&u, 1);
    const std::vector<float> row = last.to(kCPU).to_vector<float>();  // the host reads the logits
    const int32_t next = sample_token(row.data(), V, opt.temperature, opt.top_k, u);
    out.push_back(next);
    context.push_back(next);
    if (on_token) on_token(next);
    if (n + 1 == opt.max_new_tokens) break;
    if (cache.length >= T)
      prefill();  // the window is full: restart the cache from the last T / 2 tokens
    else
      logits = model.forward_cached(from_vector(std::vector<int32_t>{next}, {1, 1}), cache);
  }
  return out;
}

}  // namespace kuai::nn
