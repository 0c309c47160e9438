// Full checkpoints: an interrupted and resumed run gives the same losses and weights, bit for
// bit, as an uninterrupted one (with accumulation and 2 loader workers); corrupt, truncated and
// malformed checkpoints give named errors; retention keeps the newest; a failing write (file
// size limit) leaves the previous checkpoint intact and training continues or stops as
// configured; SIGKILL at random moments during saves never loses the previous checkpoint.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <thread>

#include "kuai/core/allocator.h"
#include "kuai/data/token_file.h"
#include "kuai/io/export.h"
#include "kuai/io/hf_llama.h"
#include "kuai/io/safetensors.h"
#include "kuai/train/checkpoint.h"
#include "kuai/train/trainer.h"

extern char** environ;

namespace kuai::train {
namespace {

namespace fs = std::filesystem;

std::string corpus_path() {
  const auto path = (fs::temp_directory_path() / "kuai_ckpt_corpus.bin").string();
  if (!fs::exists(path)) {
    std::vector<int32_t> tokens(8000);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<int32_t>("In the beginning God created the heaven. "[i % 41]);
    data::write_token_file(path, tokens.data(), static_cast<int64_t>(tokens.size()), 1);
  }
  return path;
}

std::vector<std::string> small_run(const std::string& dir, const std::string& name) {
  return {"--run.dir=" + dir,     "--run.name=" + name,
          "--model.n_layer=2",    "--model.d_model=32",
          "--model.n_head=2",     "--model.seq_len=16",
          "--train.batch_size=4", "--train.accum_steps=2",
          "--train.steps=10",     "--train.log_every=1000",
          "--train.eval_every=0", "--train.warmup_steps=2",
          "--data.workers=2",     "--log.tensorboard=false",
          "--log.jsonl=false",    "--data.path=" + corpus_path()};
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / name;
  fs::remove_all(d);
  return d;
}

// `resumed`: overrides of the resumed run's config (a checkpoint of offloaded state resumes in
// memory, and the other way round).
void expect_resume_is_bit_exact(const std::string& precision,
                                const std::vector<std::string>& extra = {},
                                const std::string& tag = "",
                                const std::vector<std::string>& resumed = {}) {
  const fs::path dir =
      fresh_dir("kuai_ckpt_resume_" + precision + (extra.empty() ? "" : "_x") + tag);
  std::vector<std::string> args = small_run(dir.string(), "full");
  args.insert(args.end(), extra.begin(), extra.end());
  args.push_back("--checkpoint.save_every=4");
  args.push_back("--train.precision=" + precision);
  // fp16: the scale doubles after every clean step until the gradients overflow, then halves and
  // the step is skipped, so it is far from its initial value when saved, and a resume that
  // restarted it would skip other steps than the uninterrupted run.
  if (precision == "fp16") args.push_back("--train.loss_scale_growth_interval=1");
  std::ostringstream out;
  const TrainResult full = run_training(load_config("", args), out);
  ASSERT_EQ(full.losses.size(), 10u);

  // The same run stopped after step 6 (as Ctrl-C does: a checkpoint is saved on the way out).
  args[1] = "--run.name=cut";
  const TrainConfig cut_cfg = load_config("", args);
  std::atomic<bool> stop{false};
  TrainOptions o;
  o.stop = &stop;
  o.after_step = [&](int64_t step) {
    if (step == 6) stop = true;
  };
  const TrainResult first = run_training(cut_cfg, out, o);
  ASSERT_TRUE(first.interrupted);
  ASSERT_EQ(first.steps_done, 6);
  ASSERT_EQ(first.losses.size(), 6u);
  const fs::path cut_dir = dir / "cut";
  EXPECT_EQ(resolve_checkpoint(cut_dir.string()), (cut_dir / "ckpt-6").string());
  // fp16 keeps its loss scale in the checkpoint; fp32 and bf16 have none.
  const Checkpoint saved = read_checkpoint((cut_dir / "ckpt-6").string());
  EXPECT_EQ(saved.state.loss_scale.has_value(), precision == "fp16");
  if (saved.state.loss_scale) {
    EXPECT_NE(saved.state.loss_scale->scale, 65536.0f) << "the scale never moved before the save";
    EXPECT_GT(first.skipped_steps, 0) << "no step was skipped before the save";
  }

  TrainOptions r;
  r.resume = cut_dir.string();
  const TrainResult rest =
      run_training(load_config((cut_dir / "ckpt-6/config.toml").string(), resumed), out, r);
  EXPECT_EQ(rest.start_step, 6);
  ASSERT_EQ(rest.losses.size(), 4u);
  std::vector<float> joined = first.losses;
  joined.insert(joined.end(), rest.losses.begin(), rest.losses.end());
  for (size_t i = 0; i < 10; ++i)
    EXPECT_EQ(joined[i], full.losses[i]) << "step " << i + 1;  // bit for bit

  // The final weights too.
  const auto a = io::SafetensorsFile::open((dir / "full/model.safetensors").string());
  const auto b = io::SafetensorsFile::open((cut_dir / "model.safetensors").string());
  ASSERT_EQ(a.entries().size(), b.entries().size());
  for (const auto& e : a.entries()) {
    const auto* f = b.find(e.name);
    ASSERT_NE(f, nullptr) << e.name;
    const auto da = a.data(e), db = b.data(*f);
    ASSERT_EQ(da.size(), db.size());
    EXPECT_EQ(std::memcmp(da.data(), db.data(), da.size()), 0) << e.name;
  }
}

TEST(Checkpoint, ResumeIsBitExact) { expect_resume_is_bit_exact("fp32"); }
TEST(Checkpoint, ResumeIsBitExactInBf16) { expect_resume_is_bit_exact("bf16"); }
TEST(Checkpoint, ResumeIsBitExactInFp16WithTheLossScale) { expect_resume_is_bit_exact("fp16"); }
// The llama family (grouped-query attention, SwiGLU, untied output layer), fp32 and bf16.
const std::vector<std::string> kLlama = {"--model.family=llama", "--model.n_head=4",
                                         "--model.n_kv_head=2", "--model.ffn_hidden=48"};
// Offloaded moments (d_model 128: two 1 MiB chunks per moment) are streamed into the checkpoint
// and back into fresh files on resume; the checkpoint is the in-memory one's format, so either
// resumes into the other.
const std::vector<std::string> kOffload = {"--train.offload=disk", "--train.offload_chunk_mb=1",
                                           "--model.d_model=128"};
TEST(Checkpoint, OffloadResumeIsBitExact) { expect_resume_is_bit_exact("fp32", kOffload, "off"); }
TEST(Checkpoint, OffloadResumeIsBitExactInFp16WithTheLossScale) {
  expect_resume_is_bit_exact("fp16", kOffload, "off");
}
TEST(Checkpoint, OffloadedCheckpointResumesInMemoryAndBack) {
  expect_resume_is_bit_exact("fp32", kOffload, "off_mem", {"--train.offload=none"});
  expect_resume_is_bit_exact("fp32", {"--model.d_model=128"}, "mem_off",
                             {"--train.offload=disk", "--train.offload_chunk_mb=1"});
}
// Masters offloaded too (train.offload_master): the model file is streamed from the masters file
// and back into it (and the bf16/fp16 working copies) on resume; the checkpoint is the ordinary
// one, so it resumes with the masters in memory and the other way round.
TEST(Checkpoint, OffloadedMastersResumeIsBitExact) {
  std::vector<std::string> masters = kOffload;
  masters.push_back("--train.offload_master=true");
  expect_resume_is_bit_exact("bf16", masters, "master");
  expect_resume_is_bit_exact("fp16", masters, "master");
  expect_resume_is_bit_exact("bf16", masters, "master_mem", {"--train.offload_master=false"});
  expect_resume_is_bit_exact("bf16", kOffload, "mem_master", {"--train.offload_master=true"});
}
TEST(Checkpoint, LlamaResumeIsBitExact) { expect_resume_is_bit_exact("fp32", kLlama); }
TEST(Checkpoint, LlamaResumeIsBitExactInBf16) { expect_resume_is_bit_exact("bf16", kLlama); }

// ZeRO-3 (here on one rank; 2 ranks, and re-sharding onto 1 and 3, are tests/mpi): the
// checkpoint holds the model as each rank's pieces of the parameter shard (model.rank0, no whole
// model.safetensors), and resumes bit for bit: fp32, bf16 with bf16 gathers, LLaMA, the moments
// offloaded, and across layouts (a ZeRO-3 checkpoint resumed without ZeRO and the other way).
std::string error_of(const std::string& dir);

TEST(Checkpoint, Zero3ResumeIsBitExactAcrossLayouts) {
  const std::vector<std::string> z3 = {"--dist.zero=3"};
  expect_resume_is_bit_exact("fp32", z3, "z3");
  const fs::path ckpt = fs::temp_directory_path() / "kuai_ckpt_resume_fp32_xz3/cut/ckpt-6";
  EXPECT_TRUE(fs::exists(ckpt / "model.rank0.safetensors"));
  EXPECT_FALSE(fs::exists(ckpt / "model.safetensors"));
  EXPECT_TRUE(read_checkpoint(ckpt.string()).sharded_model);
  expect_resume_is_bit_exact("bf16", {"--dist.zero=3", "--dist.gather_dtype=bf16"}, "z3");
  std::vector<std::string> llama = kLlama;
  llama.push_back("--dist.zero=3");
  expect_resume_is_bit_exact("fp32", llama, "z3llama");
  std::vector<std::string> offload = kOffload;
  offload.push_back("--dist.zero=3");
  expect_resume_is_bit_exact("fp32", offload, "z3off");
  expect_resume_is_bit_exact("fp32", z3, "z3_plain", {"--dist.zero=0"});
  expect_resume_is_bit_exact("fp32", {}, "plain_z3", {"--dist.zero=3"});
  // A model shard gone: named.
  const fs::path gone = fs::temp_directory_path() / "kuai_ckpt_z3_gone";
  fs::remove_all(gone);
  fs::copy(ckpt, gone, fs::copy_options::recursive);
  fs::remove(gone / "model.rank0.safetensors");
  EXPECT_NE(error_of(gone.string()).find("model.rank0.safetensors: missing"), std::string::npos)
      << error_of(gone.string());
}

std::string bytes_of(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// `kuai export --hf` streams: from a ZeRO-3 checkpoint (each parameter assembled from the ranks'
// model shards) and from a weights file, one parameter at a time, into the same bytes as the
// export of the whole model. Measured: what the export allocates at once is at most three of the
// largest parameter (its value, a row block, its cast), well under the model.
TEST(Checkpoint, HfExportStreamsFromAShardedCheckpointAndAWeightsFile) {
  const fs::path dir = fresh_dir("kuai_ckpt_hf_stream");
  auto args = small_run(dir.string(), "r");
  args.insert(args.end(), {"--model.family=llama", "--model.n_layer=6", "--dist.zero=3",
                           "--checkpoint.save_every=2", "--train.steps=2"});
  std::ostringstream out;
  run_training(load_config("", args), out);
  const Checkpoint c = read_checkpoint((dir / "r/ckpt-2").string());
  ASSERT_TRUE(c.sharded_model);
  const TrainConfig cfg = load_config_text(c.state.config_toml, c.path + "/config.toml");
  nn::GPT whole(cfg.model, 5);
  restore_model(c, whole);
  io::export_hf((dir / "whole").string(), whole);
  int64_t largest = 0, total = 0;
  for (const auto& [name, p] : whole.named_parameters()) {
    largest = std::max(largest, p.nbytes());
    total += p.nbytes();
  }
  Allocator::get().empty_cache();
  Allocator::get().reset_peak();
  const int64_t before = Allocator::get().stats().current;
  io::export_hf((dir / "streamed").string(), cfg.model,
                [&](const auto& fn) { read_model_stream(c, cfg.model, fn); });
  const int64_t held = Allocator::get().stats().peak - before;
  EXPECT_LE(held, 3 * largest + 4096) << "the largest parameter " << largest << " B";
  EXPECT_LT(held, total / 2) << "the model " << total << " B";
  for (const char* f : {"model.safetensors", "config.json"})
    EXPECT_EQ(bytes_of(dir / "streamed" / f), bytes_of(dir / "whole" / f)) << f;
  // From the run's weights-only export, checked tensor by tensor as it streams.
  io::export_hf((dir / "from_weights").string(), cfg.model, [&](const auto& fn) {
    (void)io::read_weights_stream((dir / "r/model.safetensors").string(), fn);
  });
  EXPECT_EQ(bytes_of(dir / "from_weights/model.safetensors"),
            bytes_of(dir / "whole/model.safetensors"));
}

void flip_byte(const std::string& path, int64_t from_end) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  char c = 0;
  f.read(&c, 1);
  f.seekp(-from_end, std::ios::end);
  c = static_cast<char>(c ^ 0x10);
  f.write(&c, 1);
}

std::string error_of(const std::string& dir) {
  try {
    read_checkpoint(dir);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(Checkpoint, CorruptTruncatedAndMalformedGiveNamedErrors) {
  const fs::path dir = fresh_dir("kuai_ckpt_corrupt");
  auto args = small_run(dir.string(), "r");
  args.push_back("--checkpoint.save_every=2");
  args.push_back("--train.steps=2");
  std::ostringstream out;
  run_training(load_config("", args), out);
  const fs::path good = dir / "r/ckpt-2";
  ASSERT_EQ(error_of(good.string()), "");

  auto copy = [&](const std::string& name) {
    const fs::path d = dir / name;
    fs::copy(good, d, fs::copy_options::recursive);
    return d;
  };
  const fs::path flipped = copy("flipped");
  flip_byte((flipped / "model.safetensors").string(), 10);
  EXPECT_NE(error_of(flipped.string()).find("model.safetensors: checksum mismatch"),
            std::string::npos);

  const fs::path truncated = copy("truncated");
  fs::resize_file(truncated / "optimizer.rank0.safetensors",
                  fs::file_size(truncated / "optimizer.rank0.safetensors") - 100);
  EXPECT_NE(error_of(truncated.string()).find("optimizer.rank0.safetensors: size check failed"),
            std::string::npos);

  const fs::path garbage = copy("garbage");
  std::ofstream(garbage / "state.json") << "{\"format\": \"kuai-checkpoint\", ";
  EXPECT_NE(error_of(garbage.string()).find("state.json: not valid JSON"), std::string::npos);

  const fs::path missing = copy("missing");
  std::ofstream(missing / "state.json") << "{\"format\": \"kuai-checkpoint\", \"version\": 1}";
  EXPECT_NE(error_of(missing.string()).find("state.json: missing or malformed field"),
            std::string::npos);

  EXPECT_NE(error_of((dir / "nowhere").string()).find("not a checkpoint directory"),
            std::string::npos);
}

TEST(Checkpoint, KeepsTheNewestAndPointsLatestAtIt) {
  const fs::path dir = fresh_dir("kuai_ckpt_keep");
  auto args = small_run(dir.string(), "r");
  args.insert(args.end(),
              {"--checkpoint.save_every=1", "--checkpoint.keep_last=2", "--train.steps=5"});
  std::ostringstream out;
  const TrainResult r = run_training(load_config("", args), out);
  EXPECT_EQ(r.checkpoints_saved, 5);
  const auto all = list_checkpoints((dir / "r").string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(fs::path(all[0]).filename(), "ckpt-4");
  EXPECT_EQ(fs::path(all[1]).filename(), "ckpt-5");
  EXPECT_EQ(resolve_checkpoint((dir / "r").string()), (dir / "r/ckpt-5").string());
}

// Lowers the file size limit after `at_step`, so the next save fails with EFBIG.
struct FileSizeLimit {
  rlimit saved{};
  explicit FileSizeLimit() { getrlimit(RLIMIT_FSIZE, &saved); }
  void clamp(rlim_t bytes) {
    rlimit r = saved;
    r.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &r);
  }
  ~FileSizeLimit() { setrlimit(RLIMIT_FSIZE, &saved); }
};

TEST(Checkpoint, FailingWriteKeepsThePreviousCheckpoint) {
  std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead of killing
  for (const std::string policy : {"continue", "stop"}) {
    const fs::path dir = fresh_dir("kuai_ckpt_efbig_" + policy);
    auto args = small_run(dir.string(), "r");
    // Synchronous saves, so the limit set after step 2 cannot catch the first save in flight.
    args.insert(args.end(),
                {"--checkpoint.save_every=2", "--train.steps=6", "--log.save_weights=false",
                 "--checkpoint.async=false", "--checkpoint.on_error=" + policy});
    FileSizeLimit limit;
    TrainOptions o;
    o.after_step = [&](int64_t step) {
      if (step == 2) limit.clamp(4096);  // after the first checkpoint is written
    };
    std::ostringstream out;
    const TrainResult r = run_training(load_config("", args), out, o);
    limit.clamp(limit.saved.rlim_cur);
    EXPECT_GE(r.save_failures, 1) << policy;
    EXPECT_NE(out.str().find("checkpoint failed: "), std::string::npos) << out.str();
    EXPECT_NE(r.save_error.find(".safetensors"), std::string::npos) << r.save_error;
    if (policy == "continue") {
      EXPECT_EQ(r.steps_done, 6);
      EXPECT_FALSE(r.interrupted);
    } else {
      EXPECT_EQ(r.steps_done, 4);
      EXPECT_TRUE(r.interrupted);
    }
    // The previous checkpoint is intact and still the latest.
    const std::string latest = resolve_checkpoint((dir / "r").string());
    EXPECT_EQ(fs::path(latest).filename(), "ckpt-2");
    EXPECT_EQ(error_of(latest), "");
  }
  std::signal(SIGXFSZ, SIG_DFL);
}

// ---- SIGKILL during saves -------------------------------------------------------------------
// The test binary re-executes itself with KUAI_CKPT_CHILD=<run dir>: before main, the child
// trains (resuming from the run's latest checkpoint if there is one) with a save every step,
// until the parent kills it.

constexpr char kChildEnv[] = "KUAI_CKPT_CHILD";

[[noreturn]] void child_main(const std::string& run_dir) {
  const fs::path p(run_dir);
  auto args = small_run(p.parent_path().string(), p.filename().string());
  args.insert(args.end(), {"--checkpoint.save_every=1", "--checkpoint.keep_last=2",
                           "--train.steps=100000", "--data.workers=1"});
  TrainOptions o;
  if (fs::exists(p / "latest")) o.resume = run_dir;
  std::ostringstream out;
  try {
    run_training(load_config("", args), out, o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: %s\n", e.what());
    _exit(3);
  }
  _exit(0);
}

const bool kChildStarted = [] {
  if (const char* dir = std::getenv(kChildEnv)) child_main(dir);
  return false;
}();

pid_t spawn_child(const std::string& run_dir) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  env_strings.push_back(std::string(kChildEnv) + "=" + run_dir);
  env_strings.push_back("OMP_NUM_THREADS=1");
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string self = fs::read_symlink("/proc/self/exe").string(), filter = "--gtest_filter=-*";
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t pid = 0;
  if (posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, envp.data()) != 0) return -1;
  return pid;
}

TEST(Checkpoint, SigkillDuringSavesNeverLosesThePreviousCheckpoint) {
  const fs::path dir = fresh_dir("kuai_ckpt_kill");
  const std::string run = (dir / "r").string();
  std::mt19937 rng(12345);
  int kills = 0;
  for (int round = 0; round < 20; ++round) {
    const pid_t pid = spawn_child(run);
    ASSERT_GT(pid, 0);
    if (round == 0) {  // wait for the first checkpoint (a run that never saved has nothing to lose)
      for (int i = 0; i < 600 && !fs::exists(fs::path(run) / "latest"); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ASSERT_TRUE(fs::exists(fs::path(run) / "latest")) << "the child never saved";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 400));
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ++kills;
    } else {
      FAIL() << "the child ended by itself (status " << status << ")";
    }
    // The latest checkpoint is complete and loads.
    const std::string latest = resolve_checkpoint(run);
    ASSERT_EQ(error_of(latest), "") << "after kill " << kills;
    const Checkpoint c = read_checkpoint(latest);
    const TrainConfig cfg = load_config(latest + "/config.toml", {});
    nn::GPT model(cfg.model, 0);
    optim::AdamW opt(param_groups(model, 0.1f), {});
    ASSERT_NO_THROW(restore_checkpoint(c, model, opt)) << latest;
  }
  EXPECT_EQ(kills, 20);
  // Every kill left no partial directory that `latest` could name.
  for (const auto& e : fs::directory_iterator(run))
    EXPECT_FALSE(e.path().filename().string().ends_with(".tmp") &&
                 resolve_checkpoint(run) == e.path().string());
}

}  // namespace
}  // namespace kuai::train
