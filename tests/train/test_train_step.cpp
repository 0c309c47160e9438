// TrainStep (kuai/train/train_step.h) called on its own, outside the trainer: it reads no device
// value on the host, compiled equals eager bit for bit, an fp16 step whose gradients overflow is
// skipped (and says so in a device tensor), and a step that reads a value through to_vector()
// has the read counted and runs eagerly under compile.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kuai/amp/grad_scaler.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/train/train_step.h"
#include "kuai/train/trainer.h"

namespace kuai::train {
namespace {

nn::GPTConfig tiny() {
  nn::GPTConfig c;
  c.vocab_size = 61;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 32;
  c.seq_len = 16;
  return c;
}

std::vector<data::Batch> batches(int step, int64_t k) {
  Generator g(700 + static_cast<uint64_t>(step), 0);
  std::vector<data::Batch> b;
  for (int64_t i = 0; i < k; ++i)
    b.push_back({g.randint({2, 16}, 0, 61), g.randint({2, 16}, 0, 61)});
  return b;
}

// A model, its AdamW and scaler, and the step over them.
struct Rig {
  explicit Rig(StepOptions o, float init_scale = 65536.0f,
               std::function<Tensor(const Tensor&)> tap = {})
      : model(tiny(), 5),
        opt(param_groups(model, 0.1f), optim::AdamWOptions{}),
        scaler(amp::GradScalerOptions{init_scale, 2.0f, 0.5f, 2000, o.compute == DType::kF16}) {
    o.log = [this](const std::string& m) { said.push_back(m); };
    step = std::make_unique<TrainStep>(
        model,
        [this, tap](const Tensor& x, const Tensor& y) {
          Tensor l = model.loss(x, y);
          return tap ? tap(l) : l;
        },
        opt, scaler, o);
  }
  nn::GPT model;
  optim::AdamW opt;
  amp::GradScaler scaler;
  std::vector<std::string> said;
  std::unique_ptr<TrainStep> step;
};

TEST(TrainStep, StepsOnItsOwnAndReadsNoDeviceValue) {
  StepOptions o;
  o.accum_steps = 2;
  Rig s(o);
  const int64_t reads = host_reads_this_thread();
  std::vector<StepOutputs> outs;
  for (int i = 0; i < 6; ++i) outs.push_back(s.step->step(batches(i % 2, 2)));
  EXPECT_EQ(host_reads_this_thread(), reads);
  EXPECT_FALSE(outs[0].skipped.defined());  // no scaler: nothing to skip
  EXPECT_TRUE(std::isfinite(outs[0].loss.item()));
  EXPECT_GT(outs[0].grad_norm.item(), 0.0f);
  EXPECT_LT(outs[5].loss.item(), outs[1].loss.item());  // the same two batches, learned
  EXPECT_THROW(s.step->step(batches(0, 1)), std::invalid_argument);  // one micro-batch of two
}

TEST(TrainStep, CompiledEqualsEagerBitForBit) {
  for (DType compute : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(std::string(dtype_name(compute)));
    StepOptions o;
    o.accum_steps = 2;
    o.compute = compute;
    Rig eager(o);
    o.compile = true;
    Rig compiled(o);
    for (int i = 0; i < 4; ++i) {
      const StepOutputs a = eager.step->step(batches(i, 2)), b = compiled.step->step(batches(i, 2));
      EXPECT_EQ(a.loss.item(), b.loss.item()) << "step " << i;
      EXPECT_EQ(a.grad_norm.item(), b.grad_norm.item()) << "step " << i;
      if (compute == DType::kF16) {
        EXPECT_EQ(a.loss_scale.item(), b.loss_scale.item());
        EXPECT_EQ(a.skipped.item(), b.skipped.item());
      }
    }
    ASSERT_NE(compiled.step->compiled(), nullptr);
    EXPECT_EQ(compiled.step->compiled()->captures(), 1);
    EXPECT_GE(compiled.step->compiled()->replays(), 2);
    EXPECT_FALSE(compiled.step->compiled()->eager());
    const auto pa = eager.model.parameters(), pb = compiled.model.parameters();
    for (size_t i = 0; i < pa.size(); ++i)
      EXPECT_EQ(pa[i].to_vector<float>(), pb[i].to_vector<float>()) << "parameter " << i;
  }
}

TEST(TrainStep, AnFp16StepWhoseGradientsOverflowIsSkipped) {
  StepOptions o;
  o.compute = DType::kF16;
  Rig s(o, 1e30f);  // every gradient overflows fp16
  const std::vector<float> before = s.model.parameters()[0].to_vector<float>();
  const StepOutputs out = s.step->step(batches(0, 1));
  EXPECT_EQ(out.skipped.item(), 1.0f);
  EXPECT_EQ(out.loss_scale.item(), 1e30f);
  EXPECT_EQ(s.scaler.scale(), 5e29f);                             // backed off
  EXPECT_EQ(s.model.parameters()[0].to_vector<float>(), before);  // not updated
}

// A loss function that reads the loss on the host through to_vector() (as a logging habit would):
// the read is counted as the step's, and compile, which cannot replay a host read, runs the step
// eagerly, said once.
TEST(TrainStep, AReadThroughToVectorInsideTheStepIsCountedAndRunsEagerly) {
  int64_t seen = 0;
  auto tap = [&seen](const Tensor& l) {
    if (l.to_vector<float>()[0] > 0.0f) ++seen;
    return l;
  };
  StepOptions o;
  Rig eager(o, 65536.0f, tap);
  const int64_t reads = host_reads_this_thread();
  eager.step->step(batches(0, 1));
  EXPECT_EQ(host_reads_this_thread(), reads + 1);

  o.compile = true;
  Rig compiled(o, 65536.0f, tap);
  for (int i = 0; i < 3; ++i) compiled.step->step(batches(i, 1));
  ASSERT_NE(compiled.step->compiled(), nullptr);
  EXPECT_TRUE(compiled.step->compiled()->eager());
  ASSERT_EQ(compiled.said.size(), 1u);
  EXPECT_NE(compiled.said[0].find("read 1 device value on the host"), std::string::npos)
      << compiled.said[0];
  EXPECT_EQ(seen, 4);  // the eager step's and all three compiled calls'
}

}  // namespace
}  // namespace kuai::train
