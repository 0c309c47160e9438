// ZeRO-3 on 2 ranks (distributed/zero3.h), run with the other multi-rank tests under
// `mpirun -np 2 kuai_mpi_tests`:
//   - the trainer with dist.zero = 3 against DDP (dist.zero = 0) with the same global batch, fp32,
//     10 steps on KJV: the losses and the exported weights bit for bit (for 2 ranks a
//     reduce-scatter adds the same two numbers as the all-reduce, the update is elementwise and
//     the clipping norm is the same sum of squares in float64), for GPT-2 (tied) and LLaMA
//     (untied), with every gather option, with recomputation (a replayed block gathers its unit
//     again), in bf16 with bf16 gathers, and with 2 micro-batches
//     (whole gradients across them bit for bit; each reduce-scattered into the shard within 1e-6
//     relative); and all of it under train.compile (the captured step's replays);
//   - with gradient compression (bf16; fp16 with error feedback) on the reduce-scatter, ZeRO-2 and
//     ZeRO-3 equal DDP with the same compression bit for bit;
//   - no rank holds the whole model while it is built (built on meta, shards filled from the seed);
//   - the export of a ZeRO-3 run reloads to the trained model's logits bit for bit;
//   - the per-rank allocator peak of a model whose parameters dominate, against ZeRO-2's and
//     against kuai plan's prediction.
// --kill-gather-demo (a ctest case of its own): rank 1 dies before a step's first all-gather;
// rank 0 names it and the run ends.
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>

#include "kuai/amp/autocast.h"
#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/process_group.h"
#include "kuai/distributed/zero.h"
#include "kuai/distributed/zero3.h"
#include "kuai/io/export.h"
#include "kuai/io/hf_llama.h"
#include "kuai/io/safetensors.h"
#include "kuai/nn/gpt.h"
#include "kuai/plan/trace.h"
#include "kuai/train/step_parts.h"
#include "kuai/train/trainer.h"
#include "tests/mpi/expect_close.h"

namespace kuai::dist {
namespace {

namespace fs = std::filesystem;

const std::string kKjv = std::string(KUAI_SOURCE_DIR) + "/data/kjv.bin";
int pg_rank() { return mpi_process_group()->rank(); }

struct Outcome {
  std::vector<float> losses;
  std::string weights;  // the exported model.safetensors, its bytes (rank 0)
  int64_t peak_alloc_bytes = 0;
  int64_t compile_captures = 0;
  bool compile_eager = false;
};

constexpr int64_t kSteps = 10;  // of every train_run

// `options`: what a test adds to the run's TrainOptions (hooks), besides the group.
Outcome train_run(const std::string& name, const std::vector<std::string>& extra,
                  const std::function<void(train::TrainOptions&)>& options = {}) {
  auto pg = mpi_process_group();
  const fs::path dir = fs::temp_directory_path() / "kuai_mpi_zero3";
  if (pg->rank() == 0) fs::remove_all(dir / name);
  pg->barrier();
  std::vector<std::string> args = {
      "--model.n_layer=3",  "--model.d_model=32",      "--model.n_head=2",
      "--model.seq_len=32", "--train.batch_size=4",    "--train.steps=" + std::to_string(kSteps),
      "--train.lr=3e-3",    "--train.warmup_steps=2",  "--train.eval_every=5",
      "--data.workers=1",   "--data.path=" + kKjv,     "--log.progress=off",
      "--log.jsonl=false",  "--log.tensorboard=false", "--run.dir=" + dir.string(),
      "--run.name=" + name};
  args.insert(args.end(), extra.begin(), extra.end());
  std::ostringstream out;
  train::TrainOptions o;
  o.group = pg;
  if (options) options(o);
  const train::TrainResult r = train::run_training(train::load_config("", args), out, o);
  Outcome run{r.losses, {}, r.peak_alloc_bytes, r.compile_captures, r.compile_eager};
  if (pg->rank() == 0) {
    std::ifstream f(dir / name / "model.safetensors", std::ios::binary);
    run.weights.assign(std::istreambuf_iterator<char>(f), {});
    EXPECT_FALSE(run.weights.empty()) << name;
  }
  pg->barrier();
  return run;
}

// Two exports hold the same tensors, each within `rel` of the other in the 2-norm of their
// difference against the norm of `want`'s. Except GPT-2's key biases (the middle third of
// c_attn.bias): a key bias adds the same q.b to every score of a query's row, which softmax
// ignores, so its exact gradient is zero and the computed one is rounding noise, which AdamW's
// m / sqrt(v) turns into steps of the learning rate's size: two sums of the same numbers in
// another order give other noise, and other key biases (that change no output).
void expect_weights_close(const std::string& got, const std::string& want, double rel,
                          const std::string& what) {
  auto open = [](const std::string& bytes, const std::string& name) {
    std::vector<std::byte> b(bytes.size());
    std::memcpy(b.data(), bytes.data(), bytes.size());
    return io::SafetensorsFile::parse(std::move(b), name);
  };
  const io::SafetensorsFile g = open(got, "got"), w = open(want, "want");
  ASSERT_EQ(g.entries().size(), w.entries().size()) << what;
  for (const io::SafetensorsEntry& e : w.entries()) {
    const io::SafetensorsEntry* o = g.find(e.name);
    ASSERT_NE(o, nullptr) << what << ": " << e.name;
    ASSERT_EQ(e.dtype, "F32");
    ASSERT_EQ(o->end - o->begin, e.end - e.begin) << e.name;
    std::vector<float> a((e.end - e.begin) / 4), b(a.size());
    std::memcpy(a.data(), g.data(*o).data(), a.size() * 4);
    std::memcpy(b.data(), w.data(e).data(), b.size() * 4);
    const bool key_bias = e.name.ends_with("attn.c_attn.bias");
    double diff = 0, norm = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (key_bias && i >= a.size() / 3 && i < 2 * a.size() / 3) continue;
      diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      norm += static_cast<double>(b[i]) * b[i];
    }
    EXPECT_LE(std::sqrt(diff), rel * std::sqrt(norm)) << what << ": " << e.name;
  }
}

TEST(MpiZero3, EqualsDdpBitForBitOnKjv) {
  const std::vector<std::string> llama = {"--model.family=llama", "--model.n_head=4",
                                          "--model.n_kv_head=2", "--model.ffn_hidden=48"};
  for (const auto& [family, model] : {std::pair{std::string("gpt2"), std::vector<std::string>{}},
                                      std::pair{std::string("llama"), llama}}) {
    std::vector<std::string> ddp_args = model, accum = model;
    accum.push_back("--train.accum_steps=2");
    const Outcome ddp = train_run(family + "_ddp", ddp_args);
    const Outcome ddp_accum = train_run(family + "_ddp_accum", accum);
    ASSERT_EQ(ddp.losses.size(), 10u);
    for (const std::vector<std::string>& opts : std::vector<std::vector<std::string>>{
             {},
             {"--dist.prefetch=0"},
             {"--dist.prefetch=2"},
             {"--dist.reshard_after_forward=false"},
             {"--train.recompute=full"},
             {"--train.recompute=selective", "--dist.prefetch=0"},
             // Compiled: the units' gathers, waits and releases, the reduce-scatters and the
             // optimizer's collectives are nodes of the captured step, replayed in its order.
             {"--train.compile=true"},
             {"--train.compile=true", "--dist.prefetch=0"},
             {"--train.compile=true", "--dist.prefetch=2", "--dist.reshard_after_forward=false"},
             {"--train.compile=true", "--train.recompute=full"},
             {"--train.compile=true", "--train.recompute=selective"}}) {
      std::vector<std::string> args = model;
      args.push_back("--dist.zero=3");
      args.insert(args.end(), opts.begin(), opts.end());
      const Outcome z = train_run(family + "_zero3", args);
      std::string what = family;
      for (const std::string& o : opts) what += " " + o;
      if (!opts.empty() && opts[0] == "--train.compile=true") {
        EXPECT_EQ(z.compile_captures, 1) << what;
        EXPECT_FALSE(z.compile_eager) << what;
      }
      EXPECT_EQ(z.losses, ddp.losses) << what;
      if (pg_rank() == 0) {
        EXPECT_TRUE(z.weights == ddp.weights) << what << ": exports differ";
      }
    }
    // bf16 autocast, the products' weights gathered in bf16: the values autocast casts them to.
    std::vector<std::string> bf16 = model;
    bf16.push_back("--train.precision=bf16");
    const Outcome ddp_bf16 = train_run(family + "_ddp_bf16", bf16);
    bf16.insert(bf16.end(), {"--dist.zero=3", "--dist.gather_dtype=bf16"});
    const Outcome zb = train_run(family + "_zero3_bf16", bf16);
    EXPECT_EQ(zb.losses, ddp_bf16.losses) << family << ", bf16 gathers";
    if (pg_rank() == 0) {
      EXPECT_TRUE(zb.weights == ddp_bf16.weights) << family << ", bf16 gathers";
    }
    bf16.push_back("--train.compile=true");
    const Outcome zbc = train_run(family + "_zero3_bf16_compiled", bf16);
    EXPECT_EQ(zbc.compile_captures, 1) << family << ", bf16 gathers compiled";
    EXPECT_EQ(zbc.losses, ddp_bf16.losses) << family << ", bf16 gathers compiled";
    if (pg_rank() == 0) {
      EXPECT_TRUE(zbc.weights == ddp_bf16.weights) << family << ", bf16 gathers compiled";
    }
    // Whole gradients across the micro-batches (FSDP's no_sync): DDP's additions, bit for bit.
    accum.push_back("--dist.zero=3");
    accum.push_back("--dist.accumulate_sharded=false");
    const Outcome za = train_run(family + "_zero3_accum", accum);
    EXPECT_EQ(za.losses, ddp_accum.losses) << family << ", 2 micro-batches";
    if (pg_rank() == 0) {
      EXPECT_TRUE(za.weights == ddp_accum.weights) << family << ", accumulation";
    }
    // Every micro-batch reduce-scattered into the shard (the default): the ranks' sum per
    // micro-batch, then over the micro-batches, where DDP sums the micro-batches on each rank
    // first; the same numbers added in another order, within 1e-6 relative.
    accum.back() = "--dist.accumulate_sharded=true";
    const Outcome zs = train_run(family + "_zero3_accum_sharded", accum);
    expect_close(zs.losses, ddp_accum.losses, 1e-6, family + ", micro-batches sharded");
    if (pg_rank() == 0) {
      expect_weights_close(zs.weights, ddp_accum.weights, 1e-6, family);
    }
    // Compiled, both ways of accumulating: the eager runs' numbers bit for bit.
    accum.push_back("--train.compile=true");
    const Outcome zsc = train_run(family + "_zero3_accum_sharded_compiled", accum);
    EXPECT_EQ(zsc.compile_captures, 1) << family << ", accumulation compiled";
    EXPECT_EQ(zsc.losses, zs.losses) << family << ", micro-batches sharded, compiled";
    accum[accum.size() - 2] = "--dist.accumulate_sharded=false";
    const Outcome zac = train_run(family + "_zero3_accum_compiled", accum);
    EXPECT_EQ(zac.losses, ddp_accum.losses) << family << ", 2 micro-batches compiled";
    if (pg_rank() == 0) {
      EXPECT_TRUE(zsc.weights == zs.weights) << family << ", accumulation sharded, compiled";
      EXPECT_TRUE(zac.weights == ddp_accum.weights) << family << ", accumulation compiled";
    }
  }
}

// Gradient compression on the reduce-scatter: ZeRO-2 and ZeRO-3 round each bucket (divided by the
// world size, plus error feedback's residual) into the wire dtype, sum it there and widen their
// part, where DDP all-reduces the same wire copy: on 2 ranks each element is the same sum of the
// same two rounded numbers, rounded once, so the losses and the exported weights are DDP's with
// the same compression, bit for bit (bf16; fp16 with error feedback).
TEST(MpiZero3, CompressedReduceScatterEqualsCompressedDdp) {
  for (const std::vector<std::string>& comp : std::vector<std::vector<std::string>>{
           {"--dist.compression=bf16"},
           {"--dist.compression=fp16", "--dist.error_feedback=true"}}) {
    const std::string tag = comp.size() > 1 ? "fp16_ef" : "bf16";
    const Outcome ddp = train_run("comp_ddp_" + tag, comp);
    ASSERT_EQ(ddp.losses.size(), 10u);
    for (const std::string zero : {"2", "3"}) {
      std::vector<std::string> args = comp;
      args.push_back("--dist.zero=" + zero);
      const Outcome z = train_run("comp_zero" + zero + "_" + tag, args);
      EXPECT_EQ(z.losses, ddp.losses) << "ZeRO-" << zero << ", " << tag;
      if (pg_rank() == 0) {
        EXPECT_TRUE(z.weights == ddp.weights)
            << "ZeRO-" << zero << ", " << tag << ": exports differ";
      }
    }
  }
}

// The export of a ZeRO-3 run (model.safetensors, written by rank 0 as the units are gathered one
// at a time) reloads into a plain model whose logits equal, bit for bit, those the trained ZeRO-3
// model computes on both ranks after its last step (each unit gathered from the shards): GPT-2
// (tied) and LLaMA (untied), and with bf16 gathers (both sides under bf16 autocast: the gathered
// bf16 weights are the casts of the exported fp32 masters).
TEST(MpiZero3, ExportReloadsToTheSameLogits) {
  const std::vector<std::string> llama = {"--model.family=llama", "--model.n_head=4",
                                          "--model.n_kv_head=2", "--model.ffn_hidden=48"};
  std::vector<int32_t> ids(2 * 32);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % 256);
  const Tensor x = from_vector(ids, {2, 32});
  for (const auto& [name, extra] :
       {std::pair{std::string("gpt2"), std::vector<std::string>{"--dist.zero=3"}},
        std::pair{std::string("llama"),
                  [&] {
                    std::vector<std::string> v = llama;
                    v.push_back("--dist.zero=3");
                    return v;
                  }()},
        std::pair{std::string("bf16"),
                  std::vector<std::string>{"--dist.zero=3", "--train.precision=bf16",
                                           "--dist.gather_dtype=bf16"}}}) {
    const bool bf16 = name == "bf16";
    train::StepParts* parts = nullptr;
    std::vector<float> trained;
    (void)train_run("logits_" + name, extra, [&](train::TrainOptions& o) {
      o.built = [&](train::StepParts& p) { parts = &p; };
      o.after_step = [&](int64_t step) {
        if (step != kSteps) return;
        autograd::NoGradGuard no_grad;
        amp::AutocastGuard autocast(bf16, DType::kBF16);
        trained =
            cast(static_cast<nn::GPT&>(*parts->model).forward(x), DType::kF32).to_vector<float>();
      };
    });
    ASSERT_FALSE(trained.empty()) << name;
    if (pg_rank() == 0) {
      const std::string path =
          (fs::temp_directory_path() / "kuai_mpi_zero3" / ("logits_" + name) / "model.safetensors")
              .string();
      nn::GPT reloaded(io::read_weights_info(path).model, 99);
      io::load_weights(path, reloaded);
      autograd::NoGradGuard no_grad;
      amp::AutocastGuard autocast(bf16, DType::kBF16);
      const std::vector<float> got = cast(reloaded.forward(x), DType::kF32).to_vector<float>();
      ASSERT_EQ(got.size(), trained.size()) << name;
      EXPECT_EQ(std::memcmp(got.data(), trained.data(), got.size() * sizeof(float)), 0)
          << name << ": the reloaded export's logits differ from the trained model's";
    }
  }
}

// The per-rank allocator peak of a model whose parameters dominate (8 blocks of width 256, batch 1
// of 32 positions). What persists per parameter: ZeRO-3 16/N bytes (the fp32 shard, the gradient
// shard, two moments), ZeRO-2 4 + 12/N (the whole fp32 parameters): on 2 ranks 8 bytes against 10,
// so 0.8 is the floor of the ratio of what persists; ZeRO-2's step adds its update's gather
// buffers and whole-bucket gradients, ZeRO-3's the units whole at once (at most prefetch + 2).
// Bar: at most 0.85 of ZeRO-2's peak. Parameters left whole (not sharded) would put it near 1.
TEST(MpiZero3, PeakOfARankIsBelowZero2sAndPlanned) {
  auto config = [](const std::string& zero) {
    return train::load_config(
        "", {"--model.n_layer=8", "--model.d_model=256", "--model.n_head=4", "--model.seq_len=32",
             "--train.batch_size=1", "--train.steps=3", "--train.eval_every=0",
             "--data.source=synthetic", "--log.progress=off", "--log.jsonl=false",
             "--log.tensorboard=false", "--log.save_weights=false", "--dist.zero=" + zero});
  };
  auto peak = [&](const std::string& zero) {
    std::ostringstream out;
    train::TrainOptions o;
    o.write_run_dir = false;
    o.group = mpi_process_group();
    Allocator::get().empty_cache();
    Allocator::get().reset_peak();
    return train::run_training(config(zero), out, o).peak_alloc_bytes;
  };
  const int64_t z2 = peak("2"), z3 = peak("3");
  RecordProperty("zero3_over_zero2_peak", std::to_string(static_cast<double>(z3) / z2));
  EXPECT_LE(static_cast<double>(z3), 0.85 * static_cast<double>(z2))
      << "ZeRO-3 " << z3 << " B, ZeRO-2 " << z2 << " B";
  // kuai plan's prediction of this rank's peak (the step traced on meta tensors; a traced
  // collective completes when it is waited for, so the trace keeps the gradient buckets DDP's
  // bound on those in flight keeps): within 5% of what was measured (the bar: 10%; on
  // the machine it was written on the two agree to 0.1 MiB), for both stages.
  for (const auto& [zero, measured] :
       {std::pair{std::string("3"), z3}, std::pair{std::string("2"), z2}}) {
    const int64_t predicted = plan::trace_step(plan::target_for(config(zero), 2)).peak_bytes;
    EXPECT_NEAR(static_cast<double>(predicted), static_cast<double>(measured), 0.05 * measured)
        << "ZeRO-" << zero << ": planned " << predicted << " B, measured " << measured << " B";
  }
}

// No rank ever holds the whole model, not even while it is built: ZeRO-3 builds it on meta and
// each rank fills its shards from the seed one parameter at a time (nn::GPT::initial_values; the
// losses equal DDP's, which builds the model whole, in EqualsDdpBitForBitOnKjv). What the build
// allocates is the parameter shard, the gradient shard and one parameter being made: at most
// (2 S + the largest parameter) floats and 256 KiB of small state; a whole model built first
// would add all of it.
TEST(MpiZero3, NoRankEverHoldsTheWholeModel) {
  const train::TrainConfig cfg =
      train::load_config("", {"--model.n_layer=8", "--model.d_model=256", "--model.n_head=4",
                              "--model.seq_len=32", "--data.source=synthetic", "--dist.zero=3"});
  Allocator::get().empty_cache();
  Allocator::get().reset_peak();
  const int64_t before = Allocator::get().stats().current;
  const std::unique_ptr<train::StepParts> parts =
      train::build_step_parts(cfg, mpi_process_group(), train::step_options(cfg), {});
  const int64_t built = Allocator::get().stats().peak - before;
  int64_t model = 0, largest = 0;
  for (const Tensor& p : parts->model->parameters()) {
    model += p.numel() * 4;
    largest = std::max<int64_t>(largest, p.numel() * 4);
  }
  const int64_t shard = parts->zero->shard_size() * 4;
  RecordProperty("build_peak_over_model", std::to_string(static_cast<double>(built) / model));
  EXPECT_LE(built, 2 * shard + largest + (256 << 10))  // + small state (the scaler, DDP's)
      << "model " << model << " B, shard " << shard << " B, largest parameter " << largest << " B";
  EXPECT_LT(built, model + shard) << "model " << model << " B";
  mpi_process_group()->barrier();
}

// Fine-tuning from Hugging Face's files (model.init_hf) with ZeRO-3: each rank fills its shards
// from the mapped files one parameter at a time (io::HfReader), so the losses and the export are
// those of DDP fine-tuning from the same files, bit for bit, and differ from training from the
// seed (the files were read); the build holds at most the shards and one parameter being joined
// (a fused weight from its row blocks: twice the largest), never the whole model.
TEST(MpiZero3, FineTunesFromHuggingFaceFilesWithoutAWholeModel) {
  auto pg = mpi_process_group();
  const std::vector<std::string> llama = {"--model.family=llama", "--model.n_head=4",
                                          "--model.n_kv_head=2", "--model.ffn_hidden=48"};
  const fs::path hf = fs::temp_directory_path() / "kuai_mpi_zero3_hf";
  // The files: a model of the run's shape made from another seed, exported by rank 0.
  auto shape_args = [&](std::vector<std::string> a) {
    std::vector<std::string> o = {"--model.n_layer=3", "--model.d_model=32", "--model.seq_len=32",
                                  "--data.source=synthetic"};
    o.insert(o.end(), a.begin(), a.end());
    return o;
  };
  if (pg->rank() == 0) {
    const train::TrainConfig c = train::load_config("", shape_args(llama));
    nn::GPT source(c.model, 1234);
    io::export_hf(hf.string(), source);
  }
  pg->barrier();
  std::vector<std::string> ddp_args = llama, zero_args = llama;
  ddp_args.push_back("--model.init_hf=" + hf.string());
  zero_args.insert(zero_args.end(), {"--model.init_hf=" + hf.string(), "--dist.zero=3"});
  const Outcome ddp = train_run("hf_ddp", ddp_args), z = train_run("hf_zero3", zero_args);
  const Outcome seed = train_run("hf_seed", llama);
  ASSERT_EQ(ddp.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(z.losses, ddp.losses);
  EXPECT_NE(ddp.losses, seed.losses) << "init_hf changed nothing";
  if (pg->rank() == 0) {
    EXPECT_TRUE(z.weights == ddp.weights) << "exports differ";
  }
  // The build, at a size where a parameter is small next to the model.
  {
    const std::vector<std::string> big = {"--model.family=llama", "--model.n_layer=8",
                                          "--model.d_model=256",  "--model.n_head=4",
                                          "--model.seq_len=32",   "--data.source=synthetic"};
    const fs::path big_hf = fs::temp_directory_path() / "kuai_mpi_zero3_hf_big";
    if (pg->rank() == 0) {
      nn::GPT source(train::load_config("", big).model, 99);
      io::export_hf(big_hf.string(), source);
    }
    pg->barrier();
    std::vector<std::string> args = big;
    args.push_back("--dist.zero=3");
    const train::TrainConfig cfg = train::load_config("", args);
    Allocator::get().empty_cache();
    Allocator::get().reset_peak();
    const int64_t before = Allocator::get().stats().current;
    const std::unique_ptr<train::StepParts> parts =
        train::build_step_parts(cfg, pg, train::step_options(cfg), {}, big_hf.string());
    const int64_t built = Allocator::get().stats().peak - before;
    int64_t model = 0, largest = 0;
    for (const Tensor& p : parts->model->parameters()) {
      model += p.numel() * 4;
      largest = std::max<int64_t>(largest, p.numel() * 4);
    }
    const int64_t shard = parts->zero->shard_size() * 4;
    EXPECT_LE(built, 2 * shard + 2 * largest + (256 << 10))
        << "model " << model << " B, shard " << shard << " B, largest parameter " << largest
        << " B";
    // Reading the files whole into a model built whole, as before, held 2 models and 2 shards.
    EXPECT_LT(built, model + shard) << "model " << model << " B";
    // The values are the files': this rank's first parameter piece against the file's.
    const dist::ZeroAdamW::Segment& s0 = parts->zero->segments()[0];
    const io::HfReader reader(big_hf.string());
    std::string name;
    for (const auto& [n, p] : parts->model->named_parameters())
      if (p.impl() == parts->zero->groups()[s0.group].params[s0.param].impl()) name = n;
    const std::vector<float> want = reader.parameter(name).to_vector<float>();
    const std::vector<float> got =
        narrow(parts->zero->parameter_shard(), 0, s0.shard_offset, s0.length).to_vector<float>();
    EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + s0.begin)) << name;
  }
  pg->barrier();
}

}  // namespace

// --kill-gather-demo: ZeRO-3 training; rank 1 dies (SIGKILL) at step 3, before the forward whose
// first all-gather rank 0 then waits in; rank 0 names it when mpirun ends the run.
int kill_gather_demo() {
  auto pg = mpi_process_group({30.0});
  nn::GPTConfig cfg;
  cfg.vocab_size = 61;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.d_model = 32;
  cfg.seq_len = 16;
  nn::GPT model(cfg, 8);
  DistributedDataParallel ddp(model, pg, {}, ShardedParameters::bucket_layout(model.units()));
  optim::AdamWOptions ao;
  ZeroAdamW opt(train::param_groups(model, 0.1f), ao, pg, ddp.bucket_params(), 3);
  ddp.shard_gradients(opt.gradient_shards());
  ShardedParameters sharded(model.units(), opt);
  model.set_unit_hooks(&sharded);
  std::vector<int32_t> ids(64);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 7) % 61);
  const Tensor x = from_vector(ids, {4, 16}), y = x;
  for (int64_t step = 0; step < 1000; ++step) {
    if (pg->rank() == 1 && step == 3) std::raise(SIGKILL);
    ddp.prepare_backward(true);
    model.loss(x, y).backward();
    ddp.finish_backward();
    opt.step(1.0f);
  }
  finalize();
  return 0;
}

}  // namespace kuai::dist
