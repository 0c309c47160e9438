// kuai::compile (kuai/compile/compile.h): the first call captures, later calls replay, and the
// numbers are eager execution's bit for bit; a call whose guards differ (an input's shape, the
// module's training flag, a replaced parameter) captures again and stays exact; past
// max_captures, or when the step reads a device value on the host while captured, the step runs
// eagerly, said once. Captured on meta, the first call records the step without running it.
#include <gtest/gtest.h>

#include "kuai/compile/compile.h"
#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/train/trainer.h"
#include "tests/compile/training_step.h"

namespace kuai {
namespace {

using compiler::test::batch_of;
using compiler::test::Trainer;

std::vector<float> values(const std::vector<Tensor>& ts) {
  std::vector<float> v;
  for (const Tensor& t : ts) v.push_back(t.item());
  return v;
}

// A batch of `rows` rows for `step` (the guard test changes the row count).
std::vector<Tensor> rows_of(int step, int64_t rows) {
  Generator g(500 + static_cast<uint64_t>(step), 0);
  return {g.randint({rows, 16}, 0, 61), g.randint({rows, 16}, 0, 61)};
}

CompileOptions options_for(Trainer& t, std::vector<std::string>* said) {
  CompileOptions o;
  o.module = &t.model;
  o.executable.poison = true;
  o.log = [said](const std::string& m) { said->push_back(m); };
  return o;
}

TEST(Compile, CapturesOnceThenReplaysWithEagerNumbers) {
  Trainer eager(DType::kBF16), compiled(DType::kBF16);
  std::vector<std::string> said;
  CompiledStep step = kuai::compile([&](const std::vector<Tensor>& b) { return compiled.step(b); },
                                    options_for(compiled, &said));
  for (int s = 0; s < 5; ++s) {
    const float lr = 1e-3f * static_cast<float>(s + 1);
    eager.opt.set_lr(lr);
    compiled.opt.set_lr(lr);
    EXPECT_EQ(values(step(batch_of(s, 2))), values(eager.step(batch_of(s, 2)))) << "step " << s;
  }
  EXPECT_EQ(step.captures(), 1);
  EXPECT_EQ(step.replays(), 4);
  EXPECT_FALSE(step.eager());
  EXPECT_TRUE(said.empty());
  EXPECT_EQ(compiled.state(), eager.state());
}

// Captured on meta (CompileOptions::capture_on_meta, what TrainStep uses): the first call records
// the step without running it and then runs the graph, so it takes what every replay takes plus
// the arena it allocates, never the eager step's memory; the numbers are eager's bit for bit in
// each precision (fp16: the scaler's skips and back-off), with 2 micro-batches, and no gradient
// is left on meta.
TEST(Compile, CapturedOnMetaTheFirstCallIsAReplayWithEagerNumbers) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Trainer eager(dtype), compiled(dtype);
    std::vector<std::string> said;
    CompileOptions o = options_for(compiled, &said);
    o.capture_on_meta = true;
    CompiledStep step =
        kuai::compile([&](const std::vector<Tensor>& b) { return compiled.step(b); }, o);
    Allocator& a = Allocator::get();
    std::vector<int64_t> peaks;  // per call: the most bytes it added to what lived before it
    for (int s = 0; s < 4; ++s) {
      const float lr = 1e-3f * static_cast<float>(s + 1);
      eager.opt.set_lr(lr);
      compiled.opt.set_lr(lr);
      a.reset_peak();
      const int64_t before = a.stats().current;
      const std::vector<Tensor> got = step(batch_of(s, 2));
      peaks.push_back(a.stats().peak - before);
      EXPECT_EQ(got[0].device(), kCPU);
      EXPECT_EQ(values(got), values(eager.step(batch_of(s, 2)))) << "step " << s;
    }
    ASSERT_NE(step.executable(), nullptr);
    EXPECT_EQ(peaks[0], step.executable()->arena_bytes() + peaks[1]);
    EXPECT_EQ(peaks[1], peaks[3]);
    EXPECT_EQ(step.captures(), 1);
    EXPECT_EQ(step.replays(), 3);
    EXPECT_FALSE(step.eager());
    EXPECT_TRUE(said.empty());
    EXPECT_EQ(compiled.state(), eager.state());
    for (const Tensor& p : compiled.model.parameters()) EXPECT_FALSE(p.grad().defined());
  }
}

TEST(Compile, AGuardThatFailsCapturesAgainAndStaysExact) {
  Trainer eager(DType::kF32), compiled(DType::kF32);
  std::vector<std::string> said;
  CompiledStep step = kuai::compile([&](const std::vector<Tensor>& b) { return compiled.step(b); },
                                    options_for(compiled, &said));
  // Rows 4, 4, 3 (a new shape), 4 (the first graph again), then eval mode (a new graph).
  const int64_t rows[] = {4, 4, 3, 4, 4};
  for (int s = 0; s < 5; ++s) {
    if (s == 4) {
      eager.model.eval();
      compiled.model.eval();
    }
    EXPECT_EQ(values(step(rows_of(s, rows[s]))), values(eager.step(rows_of(s, rows[s]))))
        << "step " << s;
  }
  EXPECT_EQ(step.captures(), 3);
  EXPECT_EQ(step.replays(), 2);
  ASSERT_EQ(said.size(), 2u);
  EXPECT_NE(said[0].find("input 0 is int32 (3, 16), was int32 (4, 16)"), std::string::npos)
      << said[0];
  EXPECT_NE(said[1].find("training flag"), std::string::npos) << said[1];
  EXPECT_EQ(compiled.state(), eager.state());
}

TEST(Compile, AReplacedStateTensorIsAGuard) {
  Trainer t(DType::kF32);
  std::vector<std::string> said;
  Tensor extra = zeros({3});
  CompileOptions o = options_for(t, &said);
  o.state = [&] { return std::vector<Tensor>{extra}; };
  CompiledStep step = kuai::compile([&](const std::vector<Tensor>& b) { return t.step(b); }, o);
  step(batch_of(0, 1));
  step(batch_of(1, 1));
  extra = zeros({3});  // new storage
  step(batch_of(2, 1));
  EXPECT_EQ(step.captures(), 2);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("replaced"), std::string::npos) << said[0];
}

TEST(Compile, PastMaxCapturesTheStepRunsEagerlySaidOnce) {
  Trainer eager(DType::kF32), compiled(DType::kF32);
  std::vector<std::string> said;
  CompileOptions o = options_for(compiled, &said);
  o.max_captures = 2;
  CompiledStep step =
      kuai::compile([&](const std::vector<Tensor>& b) { return compiled.step(b); }, o);
  for (int s = 0; s < 5; ++s)  // a new row count every step
    EXPECT_EQ(values(step(rows_of(s, 1 + s))), values(eager.step(rows_of(s, 1 + s))));
  EXPECT_TRUE(step.eager());
  EXPECT_EQ(step.captures(), 2);
  ASSERT_EQ(said.size(), 2u);  // the re-capture, then the fallback; not once per step
  EXPECT_NE(said[1].find("runs eagerly from now on"), std::string::npos) << said[1];
  EXPECT_EQ(compiled.state(), eager.state());
}

// The step branches on a device value read on the host by `read`: a replay would bake the branch
// in, so the step runs eagerly, said once, with eager numbers.
// Captured on meta, the read finds no bytes: the step is then captured while it runs, as without
// the option, and the same notice follows.
void expect_a_host_read_runs_eagerly(float (*read)(const Tensor&), bool on_meta) {
  Trainer eager(DType::kF32), compiled(DType::kF32);
  std::vector<std::string> said;
  CompileOptions o = options_for(compiled, &said);
  o.capture_on_meta = on_meta;
  auto branchy = [read](Trainer& t, const std::vector<Tensor>& b) {
    std::vector<Tensor> losses = t.step(b);
    if (read(losses[0]) > 100.0f) losses.push_back(scale(losses[0], 2.0f));
    return losses;
  };
  CompiledStep step =
      kuai::compile([&](const std::vector<Tensor>& b) { return branchy(compiled, b); }, o);
  for (int s = 0; s < 3; ++s)
    EXPECT_EQ(values(step(batch_of(s, 1))), values(branchy(eager, batch_of(s, 1))));
  EXPECT_TRUE(step.eager());
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("read 1 device value on the host"), std::string::npos) << said[0];
  EXPECT_EQ(compiled.state(), eager.state());
}

TEST(Compile, AStepThatReadsTheHostRunsEagerly) {
  for (bool on_meta : {false, true})
    expect_a_host_read_runs_eagerly([](const Tensor& t) { return t.item(); }, on_meta);
}

// The same with the read made through to_vector(): inside a step every host access to tensor
// bytes is a host read.
TEST(Compile, AStepThatReadsThroughToVectorRunsEagerly) {
  for (bool on_meta : {false, true})
    expect_a_host_read_runs_eagerly([](const Tensor& t) { return t.to_vector<float>()[0]; },
                                    on_meta);
}

// The README's example, as written there: a hand-made step (no scaler, no autocast) compiled,
// against the same step run eagerly.
TEST(Compile, TheReadmeExampleReplaysTheEagerNumbers) {
  auto make = [] { return std::make_unique<nn::GPT>(compiler::test::tiny(), 5); };
  auto model = make(), twin = make();
  optim::AdamW opt(train::param_groups(*model, 0.1f), {.lr = 1e-3f, .beta2 = 0.95f});
  optim::AdamW twin_opt(train::param_groups(*twin, 0.1f), {.lr = 1e-3f, .beta2 = 0.95f});
  auto body = [](nn::GPT& m, optim::AdamW& o, const std::vector<Tensor>& batch) {
    Tensor loss = m.loss(batch[0], batch[1]);
    loss.backward();
    o.step(optim::clip_coefficient(optim::grad_norm_tensor(m.parameters()), 1.0f));
    o.zero_grad();
    return std::vector<Tensor>{loss};
  };
  // No ensure_state(): the moments are made inside the first call, which therefore is not kept
  // as a graph (a replay would make them anew); the second call captures.
  std::vector<std::string> said;
  CompileOptions options;
  options.module = model.get();
  options.log = [&](const std::string& m) { said.push_back(m); };
  CompiledStep step = kuai::compile(
      [&](const std::vector<Tensor>& batch) { return body(*model, opt, batch); }, options);
  for (int i = 0; i < 5; ++i) {
    const std::vector<Tensor> b = batch_of(i, 1);
    opt.set_lr(1e-3f / static_cast<float>(i + 1));
    twin_opt.set_lr(1e-3f / static_cast<float>(i + 1));
    EXPECT_EQ(step(b)[0].item(), body(*twin, twin_opt, b)[0].item()) << "step " << i;
  }
  EXPECT_EQ(step.captures(), 2);
  EXPECT_EQ(step.replays(), 3);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("outlive it"), std::string::npos) << said[0];
  for (size_t i = 0; i < model->parameters().size(); ++i)
    EXPECT_EQ(model->parameters()[i].to_vector<float>(), twin->parameters()[i].to_vector<float>());
}

}  // namespace
}  // namespace kuai
