// Autoregressive sampling from a GPT with a KV cache: the prompt is run once (prefill), then each
// new token costs one cached forward of a single position. When the cache reaches the model's
// seq_len, it is rebuilt from the last seq_len / 2 tokens (one prefill per seq_len / 2 tokens),
// so long generations stay O(T) per token on average.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kuai/nn/gpt.h"

namespace kuai::nn {

struct SampleOptions {
  int64_t max_new_tokens = 200;
  float temperature = 1.0f;  // 0: greedy (argmax)
  int64_t top_k = 0;         // 0: the whole vocabulary
  uint64_t seed = 1337;
};

// Index drawn from softmax(logits / temperature) restricted to the top_k largest logits, using
// the uniform number u in [0, 1). temperature 0 gives the argmax (lowest index on ties).
int32_t sample_token(const float* logits, int64_t vocab, float temperature, int64_t top_k, float u);

// Continues `prompt` (non-empty) by up to max_new_tokens tokens; on_token (optional) sees each
// new token as it is made. Returns the new tokens.
std::vector<int32_t> generate(const GPT& model, const std::vector<int32_t>& prompt,
                              const SampleOptions& options,
                              const std::function<void(int32_t)>& on_token = {});

}  // namespace kuai::nn
