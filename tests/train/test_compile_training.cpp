// train.compile (technique 4) inside the trainer: a compiled run's losses, gradient norms and final
// weights (the safetensors file, byte for byte) equal the eager run's, with the lr schedule active
// (warmup then cosine: a baked-in lr fails), in fp32, bf16 and fp16 (loss scaler; the first steps
// skip while the scale backs off), with 2 micro-batches, at the tiny shape and at GPT-2's width
// with 2 layers, and over 50 steps of the King James Bible. The first step captures, every
// later one replays. A ZeRO run is not captured and says so.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "kuai/compile/passes.h"
#include "kuai/train/compile_bench.h"
#include "kuai/train/trainer.h"

namespace kuai::train {
namespace {

struct Case {
  std::string name;
  std::vector<std::string> overrides;
};

std::string kjv_path() { return std::string(KUAI_SOURCE_DIR) + "/data/kjv.bin"; }

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

TrainResult train(const std::vector<std::string>& overrides, bool compiled, const std::string& name,
                  std::string* log = nullptr) {
  const auto dir = std::filesystem::temp_directory_path() / "kuai_compile_runs";
  std::vector<std::string> o = {"--run.dir=" + dir.string(),
                                "--run.name=" + name + (compiled ? "_compiled" : "_eager"),
                                "--train.compile=" + std::string(compiled ? "true" : "false"),
                                "--train.eval_every=0",
                                "--train.log_every=1",
                                "--train.warmup_steps=2",
                                "--log.progress=plain",
                                "--log.tensorboard=false",
                                "--data.workers=1"};
  o.insert(o.end(), overrides.begin(), overrides.end());
  std::ostringstream out;
  TrainResult r = run_training(load_config("", o), out);
  if (log) *log = out.str();
  return r;
}

class CompiledTraining : public ::testing::TestWithParam<Case> {};

TEST_P(CompiledTraining, EqualsEagerBitForBit) {
  if (!std::filesystem::exists(kjv_path())) GTEST_SKIP() << kjv_path() << " missing: run setup";
  std::vector<std::string> o = GetParam().overrides;
  o.push_back("--data.path=" + kjv_path());
  const TrainResult eager = train(o, false, GetParam().name);
  const TrainResult compiled = train(o, true, GetParam().name);
  ASSERT_FALSE(eager.losses.empty());
  EXPECT_EQ(compiled.losses, eager.losses);
  EXPECT_EQ(compiled.grad_norms, eager.grad_norms);
  EXPECT_EQ(file_bytes(compiled.run_path + "/model.safetensors"),
            file_bytes(eager.run_path + "/model.safetensors"))
      << "final weights";
  EXPECT_EQ(compiled.compile_captures, 1);
  EXPECT_FALSE(compiled.compile_eager);
  if (GetParam().name != "separate_memory") {
    EXPECT_GT(compiled.compile_arena_bytes, 0);
  }
  EXPECT_EQ(eager.compile_captures, 0);
}

const std::vector<std::string> kTiny = {"--model.n_layer=2",    "--model.d_model=64",
                                        "--model.n_head=2",     "--model.seq_len=32",
                                        "--train.batch_size=4", "--train.steps=6"};

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

INSTANTIATE_TEST_SUITE_P(
    PrecisionsShapesAndAccumulation, CompiledTraining,
    ::testing::Values(
        Case{"fp32", kTiny}, Case{"fp32_accum2", with(kTiny, {"--train.accum_steps=2"})},
        Case{"bf16", with(kTiny, {"--train.precision=bf16"})},
        Case{"fp16_accum2", with(kTiny, {"--train.precision=fp16", "--train.accum_steps=2"})},
        Case{"separate_memory", with(kTiny, {"--train.compile_memory=separate"})},
        Case{"gpt2_width_2_layers",
             {"--model.n_layer=2", "--model.d_model=768", "--model.n_head=12", "--model.seq_len=32",
              "--train.batch_size=2", "--train.steps=5"}},
        Case{"kjv_50_steps", with(kTiny, {"--train.steps=50"})},
        // LLaMA's blocks: 4 query heads over 2 key/value heads, SwiGLU, RoPE.
        Case{"llama_fp32_accum2", with(kTiny, {"--model.family=llama", "--model.n_head=4",
                                               "--model.n_kv_head=2", "--train.accum_steps=2"})},
        Case{"llama_bf16_flash",
             with(kTiny, {"--model.family=llama", "--model.n_head=4", "--model.n_kv_head=1",
                          "--train.precision=bf16", "--model.attention=flash"})},
        Case{"llama_fp16", with(kTiny, {"--model.family=llama", "--model.n_head=4",
                                        "--model.n_kv_head=2", "--train.precision=fp16"})}),
    [](const auto& info) { return info.param.name; });

// The number a run fits or fails by: the trainer's whole-run peak of live tensors, with an
// evaluation and a checkpoint save in the run. Compiled, no step holds the eager step's memory
// (the capture runs on meta) and evaluation does not run beside the arena (it is given back).
TEST(CompiledTrainingMemory, TheWholeRunPeaksBelowEager) {
  const std::vector<std::string> o = {
      "--model.n_layer=2",       "--model.d_model=64",   "--model.n_head=2",
      "--model.seq_len=64",      "--train.batch_size=8", "--train.steps=4",
      "--data.source=synthetic", "--train.eval_every=2", "--checkpoint.save_every=2"};
  const TrainResult eager = train(o, false, "memory");
  const TrainResult compiled = train(o, true, "memory");
  EXPECT_EQ(compiled.losses, eager.losses);
  EXPECT_EQ(compiled.val_losses.size(), 2u);
  EXPECT_EQ(compiled.val_losses, eager.val_losses);
  EXPECT_EQ(compiled.compile_captures, 1);
  EXPECT_LT(compiled.peak_alloc_bytes, eager.peak_alloc_bytes);
  std::cout << "[ memory   ] whole-run peak: eager " << eager.peak_alloc_bytes << " B, compiled "
            << compiled.peak_alloc_bytes << " B (x"
            << static_cast<double>(compiled.peak_alloc_bytes) /
                   static_cast<double>(eager.peak_alloc_bytes)
            << ")\n";
}

// ZeRO is captured with its collectives (here on one rank: the single group's reduce-scatter and
// all-gather, dispatched as primitives; at stage 3 the units' gathers and releases too) and
// replays eager's numbers bit for bit.
TEST(CompiledTrainingZero, EveryStageReplaysEagerBitForBit) {
  for (const std::string zero : {"1", "2", "3"}) {
    const std::vector<std::string> o =
        with(kTiny, {"--dist.zero=" + zero, "--data.source=synthetic", "--train.steps=3"});
    std::string log;
    const TrainResult compiled = train(o, true, "zero" + zero, &log);
    const TrainResult eager = train(o, false, "zero" + zero);
    EXPECT_EQ(compiled.losses, eager.losses) << "zero " << zero;
    EXPECT_EQ(compiled.grad_norms, eager.grad_norms) << "zero " << zero;
    EXPECT_EQ(log.find("not applied"), std::string::npos) << log;
    EXPECT_EQ(compiled.compile_captures, 1) << "zero " << zero;
    EXPECT_FALSE(compiled.compile_eager) << "zero " << zero;
  }
}

}  // namespace
}  // namespace kuai::train

namespace kuai::train {
namespace {

// `kuai bench compile`: every arm trains the same steps; the compiled arms' losses equal eager's
// (the bench checks it at every step), each fusion off gives a larger graph than all on (the
// elementwise chain fuser finds nothing in the GPT), and recompute off a smaller graph in a larger
// arena.
TEST(CompileBench, ArmsInterleaveAndMatchEager) {
  const TrainConfig c =
      load_config("", {"--model.n_layer=2", "--model.d_model=32", "--model.n_head=2",
                       "--model.seq_len=16", "--train.batch_size=2", "--data.source=synthetic"});
  std::ostringstream progress;
  const CompileBench b = run_compile_bench(c, 4, 1, progress);
  EXPECT_TRUE(b.losses_equal) << progress.str();
  ASSERT_EQ(b.arms.size(), 2 + compiler::PassOptions::names().size());
  EXPECT_FALSE(b.arms[0].compiled);
  for (const CompileBenchArm& a : b.arms) EXPECT_EQ(a.step_ms.size(), 3u) << a.label;
  for (size_t i = 2; i < b.arms.size(); ++i)
    if (b.arms[i].disabled == "recompute") {
      EXPECT_LT(b.arms[i].nodes, b.arms[1].nodes) << b.arms[i].label;
      EXPECT_GT(b.arms[i].arena_bytes, b.arms[1].arena_bytes) << b.arms[i].label;
    } else if (b.arms[i].disabled == "elementwise") {  // the GPT has no chain left to fuse
      EXPECT_EQ(b.arms[i].nodes, b.arms[1].nodes) << b.arms[i].label;
    } else {
      EXPECT_GT(b.arms[i].nodes, b.arms[1].nodes) << b.arms[i].label;
    }
  EXPECT_GT(b.arms[1].arena_bytes, 0);
  const std::string md = compile_bench_markdown({b});
  EXPECT_NE(md.find("yes, bit for bit"), std::string::npos) << md;
}

}  // namespace
}  // namespace kuai::train
