// Sampling with a KV cache: cached logits equal a full forward at every position (naive and flash
// attention); the sampler's
// temperature / top-k / greedy rules; generation is reproducible and runs past seq_len.
#include <gtest/gtest.h>

#include <cmath>

#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/nn/generate.h"
#include "kuai/nn/optimize.h"

namespace kuai::nn {

// gtest prints parameters with this (found by argument-dependent lookup) instead of their bytes.
void PrintTo(const GPTConfig& c, std::ostream* os) { *os << describe(c); }

namespace {

GPTConfig tiny() {
  GPTConfig c;
  c.vocab_size = 50;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 16;
  c.seq_len = 12;
  return c;
}

GPTConfig tiny_llama(int64_t kv_heads) {
  GPTConfig c = tiny();
  c.family = "llama";
  c.n_head = 4;
  c.n_kv_head = kv_heads;
  c.ffn_hidden = 24;
  return c;
}

class KVCacheTest : public ::testing::TestWithParam<GPTConfig> {};

TEST_P(KVCacheTest, CachedLogitsEqualFullForward) {
  // Naive (prefill by the naive primitive, then matmul/softmax/matmul per token) and flash (the
  // flash kernel for both: the new query rows against the cached keys). For llama the cache holds
  // the rotated keys of the key/value heads, and each new row is rotated by its position.
  for (AttentionImpl impl : {AttentionImpl::kNaive, AttentionImpl::kFlash}) {
    GPT model(GetParam(), 5);
    optimize(model, impl);
    Generator g(11, 0);
    const Tensor idx = g.randint({1, 10}, 0, 50);
    const auto full_logits = model.forward(idx).to_vector<float>();  // (1, 10, 50)
    KVCache cache;
    std::vector<float> cached = model.forward_cached(contiguous(narrow(idx, 1, 0, 4)), cache)
                                    .to_vector<float>();  // prefill of 4
    for (int64_t t = 4; t < 10; ++t) {
      const auto row =
          model.forward_cached(contiguous(narrow(idx, 1, t, 1)), cache).to_vector<float>();
      cached.insert(cached.end(), row.begin(), row.end());
    }
    EXPECT_EQ(cache.length, 10);
    ASSERT_EQ(cached.size(), full_logits.size());
    // Two fp32 evaluation orders of the same attention: within 1e-5 absolute (logits are O(1)).
    for (size_t i = 0; i < cached.size(); ++i)
      ASSERT_NEAR(cached[i], full_logits[i], 1e-5) << attention_impl_name(impl) << " " << i;
    EXPECT_THROW(model.forward_cached(contiguous(narrow(idx, 1, 0, 3)), cache),
                 std::invalid_argument);
  }
}

INSTANTIATE_TEST_SUITE_P(Family, KVCacheTest,
                         ::testing::Values(tiny(), tiny_llama(2), tiny_llama(1), tiny_llama(4)),
                         [](const auto& info) {
                           return info.param.family + "_kv" + std::to_string(info.param.kv_heads());
                         });

TEST(Sampler, GreedyTopKAndTemperature) {
  const float logits[4] = {0.0f, std::log(2.0f), std::log(1.0f), 3.0f};
  EXPECT_EQ(sample_token(logits, 4, 0.0f, 0, 0.99f), 3);  // greedy
  EXPECT_EQ(sample_token(logits, 4, 1.0f, 1, 0.99f), 3);  // top-1 is greedy
  // top-2 keeps {3: e^3, 1: 2}: probabilities e^3/(e^3+2) ~ 0.909 and 0.091.
  EXPECT_EQ(sample_token(logits, 4, 1.0f, 2, 0.5f), 3);
  EXPECT_EQ(sample_token(logits, 4, 1.0f, 2, 0.95f), 1);
  // A very high temperature flattens the distribution: u near 1 reaches the last candidate.
  const float flat[3] = {0.0f, 0.0f, 0.0f};
  EXPECT_EQ(sample_token(flat, 3, 1.0f, 0, 0.1f), 0);
  EXPECT_EQ(sample_token(flat, 3, 1.0f, 0, 0.5f), 1);
  EXPECT_EQ(sample_token(flat, 3, 1.0f, 0, 0.9f), 2);
}

class Generate : public ::testing::TestWithParam<GPTConfig> {};

TEST_P(Generate, ReproducibleGreedyMatchesFullRecomputationAndRunsPastSeqLen) {
  const GPT model(GetParam(), 9);
  const std::vector<int32_t> prompt = {1, 2, 3};
  SampleOptions o;
  o.max_new_tokens = 8;  // stays inside seq_len 12
  o.temperature = 0.0f;
  const auto fast = generate(model, prompt, o);
  std::vector<int32_t> ctx = prompt, slow;
  for (int n = 0; n < 8; ++n) {  // no cache: the whole context every time
    const auto logits =
        model.forward(from_vector(ctx, {1, static_cast<int64_t>(ctx.size())})).to_vector<float>();
    const float* last = logits.data() + (ctx.size() - 1) * 50;
    slow.push_back(sample_token(last, 50, 0.0f, 0, 0.0f));
    ctx.push_back(slow.back());
  }
  EXPECT_EQ(fast, slow);

  o.temperature = 1.0f;
  o.top_k = 10;
  o.max_new_tokens = 40;  // more than seq_len: the cache restarts from the last seq_len / 2
  const auto a = generate(model, prompt, o), b = generate(model, prompt, o);
  EXPECT_EQ(a.size(), 40u);
  EXPECT_EQ(a, b);
  o.seed += 1;
  EXPECT_NE(generate(model, prompt, o), a);
}

INSTANTIATE_TEST_SUITE_P(Family, Generate, ::testing::Values(tiny(), tiny_llama(2)),
                         [](const auto& info) { return info.param.family; });

}  // namespace
}  // namespace kuai::nn
