// Activation recomputation (kuai/nn/checkpoint.h): a checkpointed region gives the gradients of
// the plain forward bit for bit (a user's own function, GPT and LLaMA blocks, naive and flash
// attention, fp32 / bf16 / fp16 with the scaler, accumulation, compile), drops what it says it
// drops (the memory held from forward to backward falls), replays once per region, and refuses
// what a replay would repeat.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kuai/amp/autocast.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/nn/checkpoint.h"
#include "kuai/nn/gpt.h"
#include "kuai/nn/optimize.h"
#include "kuai/optim/adamw.h"
#include "kuai/train/step_parts.h"
#include "kuai/train/train_step.h"

namespace kuai::nn {
namespace {

std::vector<uint32_t> bits(const Tensor& t) {
  const std::vector<float> v = t.contiguous().to(DType::kF32).to_vector<float>();
  std::vector<uint32_t> b(v.size());
  std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
  return b;
}

// A user's function of two inputs and three parameters: a norm, a product, GELU, a residual.
struct UserBlock {
  explicit UserBlock(Generator& g)
      : w(g.normal({24, 16}, 0.0f, 0.2f).requires_grad_()),
        lw(g.normal({16}, 1.0f, 0.1f).requires_grad_()),
        lb(g.normal({16}, 0.0f, 0.1f).requires_grad_()) {}
  std::vector<Tensor> operator()(const std::vector<Tensor>& in) const {
    Tensor h = linear(layer_norm(in[0], lw, lb, 1e-5f), w, Tensor());  // (N, 24)
    Tensor a = gelu(h);
    return {add(narrow(a, 1, 0, 16), in[1]), sum(mul(a, a))};
  }
  std::vector<Tensor> params() const { return {w, lw, lb}; }
  Tensor w, lw, lb;
};

// Gradients of the parameters and inputs after backward of a loss over fn's outputs.
std::vector<std::vector<uint32_t>> user_grads(Recompute policy) {
  Generator g(11, 0);
  UserBlock f(g);
  Tensor x = g.normal({5, 16}, 0.0f, 1.0f).requires_grad_();
  Tensor r = g.normal({5, 16}, 0.0f, 1.0f).requires_grad_();
  std::vector<Tensor> out =
      checkpoint([&f](const std::vector<Tensor>& in) { return f(in); }, {x, r}, policy);
  Tensor loss = add(sum(mul(out[0], out[0])), out[1]);
  loss.backward();
  std::vector<std::vector<uint32_t>> g_all = {bits(loss)};
  for (const Tensor& p : f.params()) g_all.push_back(bits(p.grad()));
  g_all.push_back(bits(x.grad()));
  g_all.push_back(bits(r.grad()));
  return g_all;
}

TEST(Recompute, AUsersFunctionGivesTheSameGradientsBitForBit) {
  const auto plain = user_grads(Recompute::kNone);
  for (Recompute p : {Recompute::kSelective, Recompute::kFull}) {
    SCOPED_TRACE(recompute_name(p));
    reset_recompute_stats();
    EXPECT_EQ(user_grads(p), plain);
    const RecomputeStats s = recompute_stats();
    EXPECT_EQ(s.regions, 1);
    EXPECT_EQ(s.replays, 1);
    EXPECT_GT(s.dropped_bytes, 0);
    EXPECT_GT(s.replayed_ops, 0);
    // selective keeps the product's output (N, 24); full keeps nothing made inside.
    if (p == Recompute::kSelective) {
      EXPECT_EQ(s.kept_bytes, 5 * 24 * 4);
    } else {
      EXPECT_EQ(s.kept_bytes, 0);
    }
  }
}

TEST(Recompute, OutsideGradModeItOnlyCallsTheFunction) {
  Generator g(3, 0);
  UserBlock f(g);
  Tensor x = g.normal({5, 16}, 0.0f, 1.0f), r = g.normal({5, 16}, 0.0f, 1.0f);
  reset_recompute_stats();
  autograd::NoGradGuard no_grad;
  auto out = checkpoint([&f](const std::vector<Tensor>& in) { return f(in); }, {x, r});
  EXPECT_EQ(bits(out[0]), bits(f({x, r})[0]));
  EXPECT_EQ(recompute_stats().regions, 0);
}

TEST(Recompute, RefusesAnOpThatWritesItsInputInPlace) {
  Generator g(3, 0);
  Tensor x = g.normal({4, 4}, 0.0f, 1.0f).requires_grad_();
  Tensor acc = zeros({4, 4});
  try {
    checkpoint(
        [&acc](const Tensor& in) {
          Tensor y = mul(in, in);
          add_(acc, y.detach());
          return y;
        },
        x);
    FAIL() << "an in-place op inside a region was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("in place inside a recomputed region"), std::string::npos)
        << e.what();
  }
}

TEST(Recompute, ParsesThePolicyNames) {
  EXPECT_EQ(parse_recompute("none"), Recompute::kNone);
  EXPECT_EQ(parse_recompute("selective"), Recompute::kSelective);
  EXPECT_EQ(parse_recompute("full"), Recompute::kFull);
  EXPECT_THROW(parse_recompute("all"), std::invalid_argument);
}

// ---- whole models through TrainStep ----

GPTConfig tiny(bool llama) {
  GPTConfig c;
  c.vocab_size = 61;
  c.n_layer = 3;
  c.n_head = 4;
  c.d_model = 32;
  c.seq_len = 16;
  if (llama) {
    c.family = "llama";
    c.n_kv_head = 2;
  }
  return c;
}

std::vector<data::Batch> batches(int step, int64_t k) {
  Generator g(900 + static_cast<uint64_t>(step), 0);
  std::vector<data::Batch> b;
  for (int64_t i = 0; i < k; ++i)
    b.push_back({g.randint({2, 16}, 0, 61), g.randint({2, 16}, 0, 61)});
  return b;
}

struct Trained {
  std::vector<uint32_t> losses, norms;
  std::vector<std::vector<uint32_t>> weights;
  bool operator==(const Trained& o) const {
    return losses == o.losses && norms == o.norms && weights == o.weights;
  }
};

struct Case {
  bool llama = false;
  AttentionImpl attention = AttentionImpl::kNaive;
  DType compute = DType::kF32;
  int64_t accum = 1;
  bool compile = false;
  Recompute recompute = Recompute::kNone;
  int64_t layers = -1;
};

Trained train3(const Case& s) {
  GPT model(tiny(s.llama), 5);
  optimize(model, s.attention);
  model.set_recompute(s.recompute, s.layers);
  optim::AdamW opt(train::param_groups(model, 0.1f), optim::AdamWOptions{});
  amp::GradScaler scaler(
      amp::GradScalerOptions{1024.0f, 2.0f, 0.5f, 2000, s.compute == DType::kF16});
  train::StepOptions o;
  o.accum_steps = s.accum;
  o.compute = s.compute;
  o.compile = s.compile;
  train::TrainStep step(
      model, [&model](const Tensor& x, const Tensor& y) { return model.loss(x, y); }, opt, scaler,
      o);
  Trained r;
  for (int i = 0; i < 3; ++i) {
    const train::StepOutputs out = step.step(batches(i, s.accum));
    r.losses.push_back(bits(out.loss)[0]);
    r.norms.push_back(bits(out.grad_norm)[0]);
  }
  if (s.compile) {
    EXPECT_NE(step.compiled(), nullptr);
    if (step.compiled()) {
      EXPECT_FALSE(step.compiled()->eager());
    }
  }
  for (const Tensor& p : model.parameters()) r.weights.push_back(bits(p));
  return r;
}

std::string label(const Case& s) {
  return fmt::format("{} {} {} accum {}{} {}", s.llama ? "llama" : "gpt2",
                     attention_impl_name(s.attention), dtype_name(s.compute), s.accum,
                     s.compile ? " compiled" : "", recompute_name(s.recompute));
}

TEST(Recompute, ModelsTrainBitForBitAsWithoutRecomputation) {
  for (bool llama : {false, true})
    for (AttentionImpl a : {AttentionImpl::kNaive, AttentionImpl::kFlash})
      for (DType c : {DType::kF32, DType::kBF16, DType::kF16}) {
        Case s;
        s.llama = llama;
        s.attention = a;
        s.compute = c;
        s.accum = c == DType::kBF16 ? 2 : 1;  // accumulation with autocast's cached casts
        const Trained plain = train3(s);
        for (Recompute p : {Recompute::kSelective, Recompute::kFull}) {
          s.recompute = p;
          SCOPED_TRACE(label(s));
          reset_recompute_stats();
          EXPECT_TRUE(train3(s) == plain);
          const RecomputeStats st = recompute_stats();
          EXPECT_EQ(st.regions, 3 * 3 * s.accum);  // 3 blocks, 3 steps
          EXPECT_EQ(st.replays, st.regions);
          EXPECT_GT(st.dropped_bytes, 0);
        }
      }
}

TEST(Recompute, AccumulationAndTheFirstLayersOnly) {
  Case s;
  s.accum = 3;
  s.attention = AttentionImpl::kFlash;
  const Trained plain = train3(s);
  s.recompute = Recompute::kFull;
  s.layers = 2;
  reset_recompute_stats();
  EXPECT_TRUE(train3(s) == plain);
  EXPECT_EQ(recompute_stats().regions, 2 * 3 * 3);  // 2 of 3 blocks, 3 micro-batches, 3 steps
}

TEST(Recompute, CompiledStepsTrainBitForBitAsEagerWithout) {
  for (DType c : {DType::kF32, DType::kBF16}) {
    for (bool llama : {false, true}) {
      Case s;
      s.llama = llama;
      s.compute = c;
      s.attention = AttentionImpl::kFlash;
      s.accum = 2;
      const Trained plain = train3(s);
      for (Recompute p : {Recompute::kSelective, Recompute::kFull}) {
        s.recompute = p;
        s.compile = true;
        SCOPED_TRACE(label(s));
        EXPECT_TRUE(train3(s) == plain);
        s.compile = false;
      }
    }
  }
}

// The memory a forward leaves for its backward: with every block recomputed, about one block
// input each instead of every block's saved activations.
int64_t held_after_forward(Recompute policy) {
  GPTConfig c = tiny(false);
  c.n_layer = 4;
  c.d_model = 64;
  c.seq_len = 64;
  c.vocab_size = 32;
  GPT model(c, 1);
  optimize(model, AttentionImpl::kFlash);
  model.set_recompute(policy);
  Generator g(2, 0);
  Tensor x = g.randint({4, 64}, 0, 32), y = g.randint({4, 64}, 0, 32);
  const int64_t before = Allocator::get().stats().current;
  Tensor loss = model.loss(x, y);
  const int64_t held = Allocator::get().stats().current - before;
  loss.backward();
  return held;
}

TEST(Recompute, ForwardLeavesLessForBackward) {
  const int64_t none = held_after_forward(Recompute::kNone);
  const int64_t selective = held_after_forward(Recompute::kSelective);
  const int64_t full = held_after_forward(Recompute::kFull);
  // The head (logits (256, 32) and the final norm) is the same in all three; per block, none
  // keeps ~17 rows of C per token, selective ~10, full 1.
  EXPECT_LT(selective, 0.75 * static_cast<double>(none)) << selective << " vs " << none;
  EXPECT_LT(full, 0.25 * static_cast<double>(none)) << full << " vs " << none;
}

}  // namespace
}  // namespace kuai::nn
