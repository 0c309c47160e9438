// Optimizer state offloaded to disk (train.offload = disk) through the trainer: the same losses,
// gradient norms and final weights as in-memory AdamW, bit for bit, alone and with recomputation,
// accumulation, bf16, fp16 with the loss scaler, compile, GPT and LLaMA; the chunk boundaries fall
// inside parameters (two chunks of 1 MiB per moment). And the failures: a failed write of the
// moments, a moments file changed under the run, and a disk too small for them each end the run
// with one line naming the file and the operation, and leave the last checkpoint intact.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "kuai/amp/autocast.h"
#include "kuai/core/ops.h"
#include "kuai/data/token_file.h"
#include "kuai/io/safetensors.h"
#include "kuai/train/checkpoint.h"
#include "kuai/train/step_parts.h"
#include "kuai/train/trainer.h"

namespace kuai::train {
namespace {

namespace fs = std::filesystem;

std::string corpus_path() {
  const auto path = (fs::temp_directory_path() / "kuai_offload_corpus.bin").string();
  if (!fs::exists(path)) {
    std::vector<int32_t> tokens(8000);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<int32_t>("And God said, Let there be light. "[i % 34]);
    data::write_token_file(path, tokens.data(), static_cast<int64_t>(tokens.size()), 1);
  }
  return path;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d;
}

// d_model 128: about 0.45 M parameters, 1.8 MB per moment: two 1 MiB chunks.
std::vector<std::string> run_args(const fs::path& dir, const std::string& name) {
  return {"--run.dir=" + dir.string(), "--run.name=" + name,     "--model.n_layer=2",
          "--model.d_model=128",       "--model.n_head=4",       "--model.seq_len=16",
          "--train.batch_size=4",      "--train.steps=5",        "--train.log_every=1000",
          "--train.eval_every=0",      "--train.warmup_steps=2", "--data.workers=1",
          "--log.tensorboard=false",   "--log.jsonl=false",      "--data.path=" + corpus_path(),
          "--train.offload_chunk_mb=1"};
}

std::vector<std::byte> weights(const fs::path& run) {
  const auto f = io::SafetensorsFile::open((run / "model.safetensors").string());
  std::vector<std::byte> all;
  for (const auto& e : f.entries()) {
    const auto d = f.data(e);
    all.insert(all.end(), d.begin(), d.end());
  }
  return all;
}

struct Case {
  std::string name;
  std::vector<std::string> args;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class OffloadTraining : public ::testing::TestWithParam<Case> {};

// Runs the case twice, in memory and with `offloaded` added, and compares them bit for bit:
// losses, gradient norms (a skipped step's NaN too), skipped steps and the final weights. The
// offloaded run's banner must show `banner`, compile must have captured it, and its scratch file
// `scratch` must be gone with the run.
void expect_offload_bit_for_bit(const std::string& name, const std::vector<std::string>& case_args,
                                const std::vector<std::string>& offloaded,
                                const std::string& banner, const std::string& scratch) {
  const fs::path dir = fresh_dir(name);
  TrainResult r[2];
  for (int off = 0; off < 2; ++off) {
    auto args = run_args(dir, off ? "disk" : "memory");
    args.insert(args.end(), case_args.begin(), case_args.end());
    if (off) args.insert(args.end(), offloaded.begin(), offloaded.end());
    std::ostringstream out;
    r[off] = run_training(load_config("", args), out);
    if (off) {
      EXPECT_NE(out.str().find(banner), std::string::npos) << out.str();
      // compile captures the offloaded update as it does AdamW's: the run is not eager.
      EXPECT_EQ(out.str().find("not applied"), std::string::npos) << out.str();
      EXPECT_FALSE(fs::exists(dir / "disk/offload/rank0" / scratch));
    }
  }
  ASSERT_EQ(r[0].losses.size(), 5u);
  ASSERT_EQ(r[1].losses.size(), 5u);
  auto bits = [](float x) { return std::bit_cast<uint32_t>(x); };
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(bits(r[0].losses[i]), bits(r[1].losses[i])) << "step " << i + 1;
    EXPECT_EQ(bits(r[0].grad_norms[i]), bits(r[1].grad_norms[i])) << "step " << i + 1;
  }
  EXPECT_EQ(r[0].skipped_steps, r[1].skipped_steps);
  EXPECT_TRUE(weights(dir / "memory") == weights(dir / "disk")) << "final weights differ";
  fs::remove_all(dir);
}

TEST_P(OffloadTraining, EqualsInMemoryAdamWBitForBit) {
  expect_offload_bit_for_bit("kuai_offload_eq", GetParam().args, {"--train.offload=disk"},
                             "optimizer state offloaded to disk", "exp_avg.bin");
}

INSTANTIATE_TEST_SUITE_P(
    AloneAndCombined, OffloadTraining,
    ::testing::Values(
        Case{"fp32", {}},
        Case{"fp32_accum3_full_recompute", {"--train.accum_steps=3", "--train.recompute=full"}},
        Case{"bf16_accum2_selective",
             {"--train.precision=bf16", "--train.accum_steps=2", "--train.recompute=selective"}},
        // The scale doubles after every clean step until the gradients overflow and a step is
        // skipped: the skipped update must leave the files as they were.
        Case{"fp16_scaler",
             {"--train.precision=fp16", "--train.loss_scale_growth_interval=1",
              "--train.loss_scale=1e6"}},
        Case{"compiled_fp32", {"--train.compile=true"}},
        Case{"compiled_bf16_full_recompute",
             {"--train.compile=true", "--train.precision=bf16", "--train.recompute=full"}},
        Case{"llama_fp32_full_recompute",
             {"--model.family=llama", "--model.n_kv_head=2", "--train.recompute=full"}}),
    [](const auto& info) { return info.param.name; });

// Masters offloaded too (train.offload_master): the products' parameters kept in the compute dtype,
// their fp32 masters in a third file; the same run as mixed precision with every fp32 parameter
// in memory, bit for bit (losses, gradient norms, final weights from the masters).
class OffloadMasters : public ::testing::TestWithParam<Case> {};

TEST_P(OffloadMasters, EqualMixedPrecisionWithTheMastersInMemoryBitForBit) {
  expect_offload_bit_for_bit("kuai_offload_master_eq", GetParam().args,
                             {"--train.offload=disk", "--train.offload_master=true"},
                             "and the fp32 master weights of", "master.bin");
}

INSTANTIATE_TEST_SUITE_P(
    AloneAndCombined, OffloadMasters,
    ::testing::Values(
        Case{"bf16_eval", {"--train.precision=bf16", "--train.eval_every=2"}},
        Case{"bf16_accum3_full_recompute",
             {"--train.precision=bf16", "--train.accum_steps=3", "--train.recompute=full"}},
        Case{"bf16_selective_flash",
             {"--train.precision=bf16", "--train.recompute=selective", "--model.attention=flash"}},
        Case{"fp16_scaler",
             {"--train.precision=fp16", "--train.loss_scale_growth_interval=1",
              "--train.loss_scale=1e6"}},
        Case{"compiled_bf16_full_recompute",
             {"--train.compile=true", "--train.precision=bf16", "--train.recompute=full"}},
        Case{"compiled_fp16_accum2",
             {"--train.compile=true", "--train.precision=fp16", "--train.accum_steps=2"}},
        // ZeRO on one rank (one shard: the whole state), its export read through the gather.
        Case{"zero1_one_rank_bf16", {"--train.precision=bf16", "--dist.zero=1"}},
        Case{"llama_bf16_full_recompute",
             {"--model.family=llama", "--model.n_kv_head=2", "--train.precision=bf16",
              "--train.recompute=full"}}),
    [](const auto& info) { return info.param.name; });

// What a working copy may feed: a product reads it as autocast's cast would have been; anything
// else would have read the fp32 master, and is refused by name.
TEST(OffloadMasters, AParameterWhoseMasterIsOffloadedFeedsOnlyProducts) {
  Tensor w = full({4, 4}, 0.5f).requires_grad_();
  const fs::path dir = fresh_dir("kuai_offload_master_guard");
  optim::OffloadOptions off;
  off.dir = dir.string();
  off.chunk_bytes = 4096;
  off.master_params = {w};
  optim::OffloadedAdamW opt({{{w}, 0.0f}}, optim::AdamWOptions{}, off);
  ASSERT_EQ(w.dtype(), DType::kBF16);
  const amp::AutocastGuard amp(true, DType::kBF16);
  const Tensor x = full({2, 4}, 1.0f);
  EXPECT_NO_THROW((void)linear(x, w, Tensor()));
  for (const auto& op : std::vector<std::function<Tensor()>>{
           [&] { return add(w, w); },   // elementwise (as is)
           [&] { return softmax(w); },  // fp32 policy
           [&] { return layer_norm(w, full({4}, 1.0f), full({4}, 0.0f), 1e-5f); }}) {
    try {
      (void)op();
      ADD_FAILURE() << "an op other than a product read a parameter whose master is offloaded";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("train.offload_master"), std::string::npos) << e.what();
    }
  }
}

// Refused where there is no second copy to move.
TEST(OffloadMasters, ConfigNamesWhatItNeeds) {
  auto error_of = [](const std::vector<std::string>& args) -> std::string {
    try {
      (void)load_config("", args);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of({"--train.offload_master=true", "--train.precision=bf16"})
                .find("needs train.offload = \"disk\""),
            std::string::npos);
  EXPECT_NE(error_of({"--train.offload_master=true", "--train.offload=disk"})
                .find("needs train.precision = \"bf16\" or \"fp16\""),
            std::string::npos);
}

// The fp16 case above really skips steps (else it would not test the skipped update).
TEST(OffloadTraining, Fp16CaseSkipsSteps) {
  const fs::path dir = fresh_dir("kuai_offload_fp16");
  auto args = run_args(dir, "r");
  args.insert(args.end(), {"--train.precision=fp16", "--train.loss_scale_growth_interval=1",
                           "--train.loss_scale=1e6", "--train.offload=disk"});
  std::ostringstream out;
  const TrainResult r = run_training(load_config("", args), out);
  EXPECT_GT(r.skipped_steps, 0);
  EXPECT_LT(r.skipped_steps, 5);
  fs::remove_all(dir);
}

std::string checkpoint_error(const std::string& dir) {
  try {
    read_checkpoint(dir);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

// Runs `args` expecting an exception; returns its message.
std::string failure_of(const std::vector<std::string>& args, const TrainOptions& o) {
  std::ostringstream out;
  try {
    run_training(load_config("", args), out, o);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(OffloadTraining, FailedWriteEndsTheRunNamingTheFileAndKeepsTheCheckpoint) {
  const fs::path dir = fresh_dir("kuai_offload_eio");
  auto args = run_args(dir, "r");
  args.insert(args.end(), {"--train.offload=disk", "--checkpoint.save_every=2",
                           "--checkpoint.async=false", "--train.steps=6"});
  TrainOptions o;
  // 2 files x 2 chunks: 4 writes per update; the 10th fails, in step 3's update.
  o.built = [](StepParts& p) { p.offloaded->stream().inject_failure(true, 9, EIO); };
  const std::string e = failure_of(args, o);
  std::printf("the run's message: %s\n", e.c_str());
  EXPECT_NE(e.find("exp_avg"), std::string::npos) << e;
  EXPECT_NE(e.find("write"), std::string::npos) << e;
  EXPECT_NE(e.find(std::strerror(EIO)), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
  const std::string latest = resolve_checkpoint((dir / "r").string());
  EXPECT_EQ(fs::path(latest).filename(), "ckpt-2");
  EXPECT_EQ(checkpoint_error(latest), "");
  fs::remove_all(dir);
}

TEST(OffloadTraining, FileChangedUnderTheRunEndsItNamingTheFile) {
  const fs::path dir = fresh_dir("kuai_offload_changed");
  auto args = run_args(dir, "r");
  args.insert(args.end(), {"--train.offload=disk", "--checkpoint.save_every=2",
                           "--checkpoint.async=false", "--train.steps=6"});
  TrainOptions o;
  const std::string file = (dir / "r/offload/rank0/exp_avg_sq.bin").string();
  o.after_step = [&](int64_t step) {
    if (step != 3) return;
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.write("kuai", 4);
  };
  const std::string e = failure_of(args, o);
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("checksum"), std::string::npos) << e;
  const std::string latest = resolve_checkpoint((dir / "r").string());
  EXPECT_EQ(fs::path(latest).filename(), "ckpt-2");
  EXPECT_EQ(checkpoint_error(latest), "");
  fs::remove_all(dir);
}

// A small tmpfs (root only; skipped elsewhere).
struct Tmpfs {
  fs::path path;
  bool mounted = false;
  Tmpfs(const fs::path& p, int64_t bytes) : path(p) {
    fs::create_directories(p);
    mounted =
        ::mount("tmpfs", p.c_str(), "tmpfs", 0, ("size=" + std::to_string(bytes)).c_str()) == 0;
  }
  ~Tmpfs() {
    if (mounted) ::umount(path.c_str());
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void full_disk_cases(const fs::path& dir) {
  // A first run saves ckpt-2 and ckpt-4 on a roomy disk.
  auto args = run_args(dir, "r");
  args.insert(args.end(), {"--train.offload=disk", "--checkpoint.save_every=2",
                           "--checkpoint.keep_last=2", "--train.steps=4"});
  {
    std::ostringstream out;
    run_training(load_config("", args), out);
  }
  // 1. Its resume with the moments on a disk with room for one of the two files: refused before
  //    the first step, naming the file and the reservation.
  const Tmpfs small(dir / "small", 2 << 20);
  if (!small.mounted) GTEST_SKIP() << "cannot mount a tmpfs here (not root?)";
  auto resume = args;
  resume.push_back("--train.steps=6");
  resume.push_back("--train.offload_dir=" + small.path.string());
  TrainOptions o;
  o.resume = (dir / "r").string();
  const std::string e = failure_of(resume, o);
  std::printf("the run's message: %s\n", e.c_str());
  EXPECT_NE(e.find(small.path.string()), std::string::npos) << e;
  EXPECT_NE(e.find("exp_avg"), std::string::npos) << e;
  EXPECT_NE(e.find(std::strerror(ENOSPC)), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
  EXPECT_EQ(fs::path(resolve_checkpoint((dir / "r").string())).filename(), "ckpt-4");
  // 2. A run whose checkpoints go to a disk with room for one: the second save fails on the
  //    streamed optimizer file, the run stops (checkpoint.on_error = stop), ckpt-2 stays.
  const Tmpfs one(dir / "one", 6 << 20);
  auto full = run_args(one.path, "r");
  full.insert(full.end(),
              {"--train.offload=disk", "--train.offload_dir=" + (dir / "off").string(),
               "--checkpoint.save_every=2", "--checkpoint.keep_last=1", "--checkpoint.async=false",
               "--checkpoint.on_error=stop", "--log.save_weights=false", "--train.steps=6"});
  std::ostringstream out;
  const TrainResult r = run_training(load_config("", full), out);
  std::printf("the save's message: %s\n", r.save_error.c_str());
  EXPECT_EQ(r.save_failures, 1) << out.str();
  EXPECT_TRUE(r.interrupted);
  EXPECT_NE(r.save_error.find("optimizer.rank0.safetensors"), std::string::npos) << r.save_error;
  EXPECT_NE(r.save_error.find(std::strerror(ENOSPC)), std::string::npos) << r.save_error;
  const std::string latest = resolve_checkpoint((one.path / "r").string());
  EXPECT_EQ(fs::path(latest).filename(), "ckpt-2");
  EXPECT_EQ(checkpoint_error(latest), "");
}

TEST(OffloadTraining, FullDiskEndsTheRunNamingTheFileAndKeepsTheCheckpoint) {
  const fs::path dir = fresh_dir("kuai_offload_full");
  full_disk_cases(dir);
  fs::remove_all(dir);
}
}  // namespace
}  // namespace kuai::train
