// Replay (kuai/compile/executable.h): a training step captured once and replayed with new batches
// gives eager execution's numbers bit for bit over 5 steps: every loss, every parameter and both
// AdamW moments compared with ==, with the learning rate changing every step (a baked-in lr
// fails), in fp32 with 1 and 2 micro-batches, bf16 autocast, and fp16 with a loss scaler and an
// overflow injected at step 3 (the step is skipped and the scale backs off on the device, in the
// graph). Replay builds no autograd node and checks the shapes and dtypes of what it is given.
#include <gtest/gtest.h>

#include "kuai/compile/capture.h"
#include "kuai/compile/executable.h"
#include "kuai/compile/passes.h"
#include "tests/compile/training_step.h"

namespace kuai::compiler {
namespace {

using test::batch_of;
using test::Trainer;

float lr_at(int step) { return 1e-3f * static_cast<float>(step + 1); }  // changes every step

using Memory = ExecutableOptions::Memory;
struct Mode {
  Memory memory;
  bool poison;
  bool passes = true;  // dead-value elimination and the fusions (passes.h)
};
class Replay : public ::testing::TestWithParam<std::tuple<DType, int, Mode>> {};

TEST_P(Replay, FiveCompiledStepsEqualEagerBitForBit) {
  const auto [dtype, micro, mode] = GetParam();
  ExecutableOptions options;
  options.memory = mode.memory;
  options.poison = mode.poison;
  Trainer eager(dtype), compiled(dtype);
  auto inject = [&](Trainer& t, int step) {  // fp16: an overflow at step 3
    if (dtype == DType::kF16 && step == 2) t.scaler.load_state({3.0e38f, 0});
  };
  std::vector<float> want, got;
  const int kSteps = 5;
  for (int step = 0; step < kSteps; ++step) {
    eager.opt.set_lr(lr_at(step));
    inject(eager, step);
    for (const Tensor& l : eager.step(batch_of(step, micro))) want.push_back(l.item());
  }
  std::unique_ptr<Executable> exe;
  for (int step = 0; step < kSteps; ++step) {
    compiled.opt.set_lr(lr_at(step));
    inject(compiled, step);
    const std::vector<Tensor> batch = batch_of(step, micro);
    std::vector<Tensor> losses;
    if (!exe) {
      Graph g = capture([&] { losses = compiled.step(batch); },
                        [&](CaptureMode& mode) {
                          for (size_t m = 0; m < losses.size(); ++m)
                            mode.mark_output("loss" + std::to_string(m), losses[m]);
                        });
      if (mode.passes) run_passes(g);
      exe = std::make_unique<Executable>(std::move(g), batch, options);
    } else {
      losses = exe->run(batch);
    }
    for (const Tensor& l : losses) got.push_back(l.item());
  }
  EXPECT_EQ(got, want);
  const auto a = eager.state(), b = compiled.state();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "state tensor " << i;
  EXPECT_EQ(compiled.opt.step_count(), eager.opt.step_count());
  // fp16: steps were skipped on the device (the injected overflow, and the first steps while the
  // scale backs off from 2^16), in the graph as in eager execution.
  if (dtype == DType::kF16) {
    EXPECT_LT(compiled.opt.step_count(), 5);
    EXPECT_EQ(compiled.scaler.scale(), eager.scaler.scale());
  } else {
    EXPECT_EQ(compiled.opt.step_count(), 5);
  }
}

// Each precision after the passes with the intermediates in one arena whose dead buffers are
// poisoned with NaN (a plan that hands out a buffer something still reads changes the numbers),
// in the arena without poison, without the passes, and each intermediate allocated on its own
// (the sanitizer builds' mode).
INSTANTIATE_TEST_SUITE_P(
    PrecisionsMicroBatchesAndMemory, Replay,
    ::testing::Values(std::tuple{DType::kF32, 1, Mode{Memory::kArena, true}},
                      std::tuple{DType::kF32, 2, Mode{Memory::kArena, true}},
                      std::tuple{DType::kBF16, 1, Mode{Memory::kArena, true}},
                      std::tuple{DType::kF16, 2, Mode{Memory::kArena, true}},
                      std::tuple{DType::kF32, 2, Mode{Memory::kArena, false}},
                      std::tuple{DType::kF32, 2, Mode{Memory::kArena, true, false}},
                      std::tuple{DType::kBF16, 1, Mode{Memory::kSeparate, false}},
                      std::tuple{DType::kF16, 2, Mode{Memory::kSeparate, false}}));

TEST(Replay, BuildsNoAutogradGraphAndChecksItsInputs) {
  Trainer t(DType::kF32);
  const std::vector<Tensor> batch = batch_of(0, 1);
  std::vector<Tensor> losses;
  Graph g = capture([&] { losses = t.step(batch); },
                    [&](CaptureMode& mode) { mode.mark_output("loss", losses[0]); });
  Executable exe(std::move(g), batch);
  const std::vector<Tensor> out = exe.run(batch_of(1, 1));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_FALSE(out[0].grad_fn()) << "no autograd node";
  EXPECT_THROW(exe.run({batch[0]}), std::invalid_argument);
  EXPECT_THROW(exe.run({zeros({2, 16}, DType::kI32), batch[1]}), std::invalid_argument);
}

}  // namespace
}  // namespace kuai::compiler
