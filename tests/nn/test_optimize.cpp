// kuai::optimize and the flash attention in a model: optimize swaps every naive attention of a
// GPT and says which; a GPT with flash attention gives the naive GPT's loss and gradients (fp32:
// within 1e-5 of the loss, gradients within 1e-4 of each tensor's scale: the two attentions sum
// in different orders); in bf16 autocast flash is as close to the fp32 model as naive is (relative
// L2 error per gradient within 1.5x); the trainer runs the same steps with model.attention =
// "flash" as with "naive", and names the key when the value is wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <sstream>
#include <string>

#include "kuai/amp/autocast.h"
#include "kuai/backend/cpu/attention_choice.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/core/ops.h"
#include "kuai/core/profiler.h"
#include "kuai/core/rng.h"
#include "kuai/nn/optimize.h"
#include "kuai/train/config.h"
#include "kuai/train/trainer.h"

namespace kuai {
namespace {

nn::GPTConfig small(int64_t T) {
  nn::GPTConfig c;
  c.vocab_size = 61;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 32;
  c.seq_len = T;
  return c;
}

TEST(Optimize, SwapsEveryNaiveAttentionAndSaysWhich) {
  nn::GPT model(small(16), 1);
  const auto before = model.named_parameters();
  const std::vector<Replaced> r = optimize(model);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].module, "h.0.attn");
  EXPECT_EQ(r[1].module, "h.1.attn");
  EXPECT_EQ(r[0].from, "naive");
  EXPECT_EQ(r[0].to, "flash");
  EXPECT_TRUE(optimize(model).empty());  // nothing left to swap
  const auto after = model.named_parameters();
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].first, before[i].first);
    EXPECT_EQ(after[i].second.raw_data(), before[i].second.raw_data());  // the same tensors
  }
  EXPECT_EQ(optimize(model, nn::AttentionImpl::kAuto).size(), 2u);
  EXPECT_THROW(nn::parse_attention_impl("fast"), std::invalid_argument);
  // LLaMA's attention modules are swapped the same way.
  nn::GPTConfig lc = small(16);
  lc.family = "llama";
  lc.n_kv_head = 1;
  nn::GPT llama(lc, 1);
  const std::vector<Replaced> lr = optimize(llama);
  ASSERT_EQ(lr.size(), 2u);
  EXPECT_EQ(lr[1].module, "layers.1.self_attn");
  EXPECT_EQ(lr[1].to, "flash");
}

struct LossAndGrads {
  float loss;
  std::vector<std::vector<float>> grads;
};

LossAndGrads run(nn::AttentionImpl impl, int64_t T, DType compute) {
  nn::GPT model(small(T), 3);
  optimize(model, impl);
  Generator g(4, 0);
  const Tensor x = g.randint({2, T}, 0, 61), y = g.randint({2, T}, 0, 61);
  Tensor loss;
  {
    amp::AutocastGuard ac(compute != DType::kF32, compute);
    loss = model.loss(x, y);
  }
  loss.backward();
  LossAndGrads out{loss.item(), {}};
  for (const Tensor& p : model.parameters()) out.grads.push_back(p.grad().to_vector<float>());
  return out;
}

double scaled_error(const std::vector<float>& got, const std::vector<float>& want) {
  double scale = 0, worst = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  return worst / (scale > 0 ? scale : 1.0);
}

TEST(Optimize, FlashGPTGivesTheNaiveLossAndGradients) {
  for (int64_t T : {1, 70, 300}) {  // one position; across the 64-row and 256-key blocks
    const LossAndGrads naive = run(nn::AttentionImpl::kNaive, T, DType::kF32);
    const LossAndGrads flash = run(nn::AttentionImpl::kFlash, T, DType::kF32);
    EXPECT_NEAR(flash.loss, naive.loss, 1e-5 * std::fabs(naive.loss)) << "T " << T;
    for (size_t i = 0; i < naive.grads.size(); ++i)
      EXPECT_LE(scaled_error(flash.grads[i], naive.grads[i]), 1e-4) << "T " << T << " param " << i;
  }
}

// Which kernels ran, from the dispatch-point profile: after optimize() the step runs the flash
// primitives forward and backward and never the naive ones (equal numbers alone would also hold
// if the swap did nothing).
TEST(Optimize, TheSwappedModelRunsTheFlashKernels) {
  const bool was_on = profiler::enabled();
  auto ops_of = [](nn::AttentionImpl impl) {
    profiler::reset();
    profiler::enable(true);
    run(impl, 70, DType::kF32);
    profiler::enable(false);
    std::set<std::string> ops;
    std::istringstream lines(profiler::report());
    std::string line;
    std::getline(lines, line);  // header
    while (std::getline(lines, line)) ops.insert(line.substr(0, line.find(' ')));
    profiler::reset();
    return ops;
  };
  const std::set<std::string> flash = ops_of(nn::AttentionImpl::kFlash);
  const std::set<std::string> naive = ops_of(nn::AttentionImpl::kNaive);
  profiler::enable(was_on);
  EXPECT_TRUE(flash.count("flash_attention") && flash.count("flash_attention_backward"));
  EXPECT_FALSE(flash.count("attention") || flash.count("attention_backward"));
  EXPECT_TRUE(naive.count("attention") && naive.count("attention_backward"));
  EXPECT_FALSE(naive.count("flash_attention") || naive.count("flash_attention_backward"));
}

// attention = "auto" runs the kernel this machine measured faster at the model's attention shape
// (a timer stands in for the clock: flash "faster" at T 400, naive at T 401); an attention too
// small to time takes the default (naive below 2048 positions). The choice is the tuning cache's.
TEST(Optimize, AutoRunsTheKernelThisMachineMeasuredFaster) {
  cpu::set_attention_timer([](const AttentionShape& s, AttentionKernel k) {
    const bool flash_wins = s.seq == 400;
    return (k == AttentionKernel::kFlash) == flash_wins ? 1e-3 : 2e-3;
  });
  const LossAndGrads auto_400 = run(nn::AttentionImpl::kAuto, 400, DType::kF32);
  const LossAndGrads auto_401 = run(nn::AttentionImpl::kAuto, 401, DType::kF32);
  cpu::set_attention_timer({});
  EXPECT_EQ(auto_400.grads, run(nn::AttentionImpl::kFlash, 400, DType::kF32).grads);
  EXPECT_NE(auto_400.grads, run(nn::AttentionImpl::kNaive, 400, DType::kF32).grads);
  EXPECT_EQ(auto_401.grads, run(nn::AttentionImpl::kNaive, 401, DType::kF32).grads);
  EXPECT_NE(auto_401.grads, run(nn::AttentionImpl::kFlash, 401, DType::kF32).grads);
  EXPECT_EQ(run(nn::AttentionImpl::kAuto, 70, DType::kF32).grads,
            run(nn::AttentionImpl::kNaive, 70, DType::kF32).grads);
  AttentionShape s = nn::attention_shape(small(400), 2, DType::kF32);
  EXPECT_EQ(cpu::TuningCache::get().find(cpu::attention_key(s)), "flash");
  s.seq = 401;
  EXPECT_EQ(cpu::TuningCache::get().find(cpu::attention_key(s)), "naive");
}

// Per tensor, the relative L2 error against the fp32 model (the max over a tensor is not used
// here: over the 32 elements of a LayerNorm weight it compares two noisy extremes of bf16
// rounding). Flash's must be within 1.5x of naive's; measured 0.9-1.1x.
double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t j = 0; j < got.size(); ++j) {
    const double e = static_cast<double>(got[j]) - want[j];
    num += e * e;
    den += static_cast<double>(want[j]) * want[j];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

TEST(Optimize, FlashInBf16IsAsCloseToFp32AsNaive) {
  const int64_t T = 130;
  const LossAndGrads ref = run(nn::AttentionImpl::kNaive, T, DType::kF32);
  const LossAndGrads naive = run(nn::AttentionImpl::kNaive, T, DType::kBF16);
  const LossAndGrads flash = run(nn::AttentionImpl::kFlash, T, DType::kBF16);
  EXPECT_LE(std::fabs(flash.loss - ref.loss), 1.5 * std::fabs(naive.loss - ref.loss) + 1e-4);
  for (size_t i = 0; i < ref.grads.size(); ++i) {
    const double e_flash = relative_l2(flash.grads[i], ref.grads[i]);
    const double e_naive = relative_l2(naive.grads[i], ref.grads[i]);
    EXPECT_LE(e_flash, 1.5 * e_naive) << "param " << i << ": naive " << e_naive;
  }
}

TEST(Optimize, TrainerRunsTheSameStepsWithFlashAttention) {
  auto losses = [](const std::string& attention) {
    const train::TrainConfig c = train::load_config(
        "", {"--model.attention=" + attention, "--model.n_layer=1", "--model.d_model=32",
             "--model.n_head=2", "--model.seq_len=80", "--train.batch_size=2", "--train.steps=4",
             "--train.eval_every=0", "--data.source=synthetic", "--log.progress=off",
             "--log.jsonl=false", "--log.tensorboard=false", "--log.save_weights=false"});
    std::ostringstream out;
    train::TrainOptions o;
    o.write_run_dir = false;
    return train::run_training(c, out, o).losses;
  };
  const std::vector<float> naive = losses("naive"), flash = losses("flash");
  ASSERT_EQ(flash.size(), naive.size());
  for (size_t i = 0; i < naive.size(); ++i)
    EXPECT_NEAR(flash[i], naive[i], 1e-4 * std::fabs(naive[i])) << "step " << i;
  try {
    train::load_config("", {"--model.attention=fast"});
    FAIL() << "expected a config error";
  } catch (const train::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.attention"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kuai
