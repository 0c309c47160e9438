// Single-process tests of ZeRO-3's sharded parameters (distributed/zero3.h; the multi-rank ones
// are tests/mpi/test_zero3.cpp): on one rank the whole mechanism runs (units gathered from the
// shard before their forward and again for their backward, released after, gradients
// reduce-scattered per unit) and training equals plain AdamW bit for bit; a parameter outside
// its unit's forward and backward has no bytes, and reading it is an error naming it; at most
// the stated number of units is whole at once; the units are gathered as the options say.
#include <gtest/gtest.h>

#include <sstream>

#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/zero.h"
#include "kuai/distributed/zero3.h"
#include "kuai/io/export.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/train/step_parts.h"
#include "kuai/train/trainer.h"

namespace kuai::dist {
namespace {

nn::GPTConfig small(const std::string& family = "gpt2", bool tied = false) {
  nn::GPTConfig c;
  c.family = family;
  c.vocab_size = 61;
  c.n_layer = 3;
  c.n_head = 2;
  c.d_model = 32;
  c.seq_len = 16;
  c.tie_embeddings = tied;
  return c;
}

struct Batch {
  Tensor x, y;
};
Batch batch(uint64_t seed) {
  Generator g(seed, 0);
  std::vector<float> v(4 * 17);
  g.uniform(v.data(), static_cast<int64_t>(v.size()), 0.0f, 61.0f);
  std::vector<int32_t> x, y;
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t t = 0; t < 16; ++t) {
      x.push_back(static_cast<int32_t>(v[r * 17 + t]));
      y.push_back(static_cast<int32_t>(v[r * 17 + t + 1]));
    }
  return {from_vector(x, {4, 16}), from_vector(y, {4, 16})};
}

// The parts of a ZeRO-3 step on one rank, as step_parts builds them.
struct Zero3Model {
  nn::GPT model;
  DistributedDataParallel ddp;
  ZeroAdamW opt;
  ShardedParameters sharded;
  Zero3Model(const nn::GPTConfig& cfg, uint64_t seed, const optim::AdamWOptions& ao,
             const Zero3Options& zo = {})
      : model(cfg, seed),
        ddp(model, single_process_group(), {}, ShardedParameters::bucket_layout(model.units())),
        opt(train::param_groups(model, 0.1f), ao, single_process_group(), ddp.bucket_params(), 3),
        sharded((ddp.shard_gradients(opt.gradient_shards()), model.units()), opt, zo) {
    model.set_unit_hooks(&sharded);
  }
  void step(const Batch& b) {
    ddp.prepare_backward(true);
    model.loss(b.x, b.y).backward();
    ddp.finish_backward();
    opt.step(0.9f);
  }
};

std::vector<std::vector<float>> whole_values(Zero3Model& z) {
  std::vector<std::vector<float>> out;
  z.sharded.for_each_unit_values(
      [&](const Tensor& p, const float* values) { out.emplace_back(values, values + p.numel()); });
  return out;
}

std::vector<std::vector<float>> unit_order_values(const nn::GPT& m) {
  std::vector<std::vector<float>> out;
  for (const nn::ModelUnit& u : m.units())
    for (const Tensor& p : u.params) out.push_back(p.to_vector<float>());
  return out;
}

TEST(Zero3, UnitsCoverEveryParameterOnceAndATiedHeadUsesTheEmbedding) {
  for (auto [family, tied] :
       {std::pair{"gpt2", true}, std::pair{"llama", false}, std::pair{"llama", true}}) {
    const nn::GPT m(small(family, tied), 1);
    const std::vector<nn::ModelUnit> u = m.units();
    ASSERT_EQ(u.size(), 5u) << family;  // embedding, 3 blocks, head
    size_t n = 0;
    for (const nn::ModelUnit& x : u) n += x.params.size();
    EXPECT_EQ(n, m.parameters().size()) << family;
    EXPECT_EQ(u.back().uses, tied ? std::vector<size_t>{0} : std::vector<size_t>{}) << family;
  }
}

// A parameter made alone (GPT::initial_values, what a ZeRO-3 model built on meta fills its
// shards from) is the constructor's, bit for bit, for both families, tied and untied.
TEST(Zero3, InitialValuesOfOneParameterAreTheConstructors) {
  for (auto [family, tied] :
       {std::pair{"gpt2", true}, std::pair{"llama", false}, std::pair{"llama", true}}) {
    const nn::GPT m(small(family, tied), 11);
    for (const auto& [name, p] : m.named_parameters()) {
      const Tensor made = Tensor::empty(p.shape());
      m.initial_values(name, made);
      EXPECT_EQ(made.to_vector<float>(), p.to_vector<float>()) << family << " " << name;
    }
    EXPECT_THROW(m.initial_values("nowhere", Tensor::empty({1})), std::invalid_argument);
  }
}

// On one rank ZeRO-3 runs every part of its mechanism; AdamW is elementwise, so the parameters
// equal plain AdamW's bit for bit, for both families, tied and untied, and whatever the gather
// options (prefetch, resharding after forward).
TEST(Zero3, OneRankTrainsBitForBitAsAdamW) {
  optim::AdamWOptions ao;
  ao.lr = 1e-2f;
  for (auto [family, tied] :
       {std::pair{"gpt2", true}, std::pair{"llama", false}, std::pair{"llama", true}}) {
    for (const Zero3Options zo : {Zero3Options{true, 1}, Zero3Options{true, 0},
                                  Zero3Options{true, 2}, Zero3Options{false, 1}}) {
      nn::GPT plain(small(family, tied), 3);
      optim::AdamW adamw(train::param_groups(plain, 0.1f), ao);
      Zero3Model z(small(family, tied), 3, ao, zo);
      for (uint64_t s = 0; s < 3; ++s) {
        const Batch b = batch(s);
        plain.zero_grad();
        plain.loss(b.x, b.y).backward();
        adamw.step(0.9f);
        z.step(b);
      }
      EXPECT_EQ(whole_values(z), unit_order_values(plain))
          << family << (tied ? " tied" : "") << ", prefetch " << zo.prefetch << ", reshard "
          << zo.reshard_after_forward;
    }
  }
}

// Between steps no parameter has bytes: reading one is an error naming it (not a read of freed
// memory); a forward without grad gathers and releases each unit; Whole makes units readable.
TEST(Zero3, AParameterOutsideItsUnitHasNoBytesAndSaysSo) {
  optim::AdamWOptions ao;
  Zero3Model z(small(), 4, ao);
  z.step(batch(1));
  for (const Tensor& p : z.model.parameters()) {
    ASSERT_TRUE(p.has_storage());
    EXPECT_TRUE(p.storage()->released);
  }
  const Tensor w = z.model.parameters()[0];
  try {
    (void)w.to_vector<float>();
    ADD_FAILURE() << "a released parameter was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("released"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)add(w, w), std::runtime_error);
  {
    autograd::NoGradGuard no_grad;
    const Batch b = batch(2);
    (void)z.model.loss(b.x, b.y);
  }
  for (size_t u = 0; u < z.sharded.num_units(); ++u) EXPECT_FALSE(z.sharded.is_whole(u)) << u;
  {
    const ShardedParameters::Whole whole(z.sharded, {0});
    EXPECT_EQ(w.to_vector<float>().size(), static_cast<size_t>(w.numel()));
  }
  EXPECT_FALSE(z.sharded.is_whole(0));
}

// Gathers per step and the units whole at once: forward gathers every unit once (the last stays
// for backward; a tied head gathers the embedding again); backward gathers again every unit whose
// ops saved a parameter, except the last; at most prefetch + 2 units are whole at once (+1: a tied
// head's embedding). Without resharding after forward, each unit is gathered once per step.
TEST(Zero3, GathersAndUnitsWholeAtOnceAreBounded) {
  optim::AdamWOptions ao;
  for (bool tied : {false, true}) {
    for (int prefetch : {0, 1, 2}) {
      Zero3Model z(small("llama", tied), 5, ao, {true, prefetch});
      z.step(batch(0));
      z.sharded.reset_stats();
      z.step(batch(1));
      const ShardedParameters::Stats s = z.sharded.stats();
      const int64_t U = static_cast<int64_t>(z.sharded.num_units());
      // Forward: U, and, tied, the embedding once more for the head (released after its own
      // forward). Backward: the blocks (U - 2); the head stayed whole with (tied) its
      // embedding, and the embedding's lookup saves no parameter.
      EXPECT_EQ(s.gathers, U + (tied ? 1 : 0) + (U - 2))
          << "prefetch " << prefetch << " tied " << tied;
      EXPECT_EQ(s.gathers_in_backward, U - 2);
      EXPECT_LE(s.max_whole, static_cast<size_t>(prefetch + 2 + (tied ? 1 : 0)))
          << "prefetch " << prefetch << " tied " << tied;
      EXPECT_GE(s.max_whole, static_cast<size_t>(std::min<int64_t>(prefetch + 1, U)));
    }
    Zero3Model keep(small("llama", tied), 5, ao, {false, 1});
    keep.step(batch(0));
    keep.sharded.reset_stats();
    keep.step(batch(1));
    EXPECT_EQ(keep.sharded.stats().gathers, static_cast<int64_t>(keep.sharded.num_units()));
    EXPECT_EQ(keep.sharded.stats().gathers_in_backward, 0);
  }
}

// The weights-only export of a ZeRO-3 model streams: each parameter is written as its unit is
// gathered, so what it holds besides the model is at most the largest unit's stored bytes (here a
// block's, a sixth of the model), never the model; the file loads into a plain model with the
// shards' values.
TEST(Zero3, TheExportStreamsUnitByUnit) {
  optim::AdamWOptions ao;
  nn::GPTConfig cfg = small("llama");
  cfg.n_layer = 6;
  Zero3Model z(cfg, 6, ao);
  z.step(batch(1));
  const std::string path = ::testing::TempDir() + "kuai_zero3_export.safetensors";
  io::ExportOptions o;
  o.sharded = [&](const io::MasterValues& fn) {
    z.sharded.for_each_unit_values(
        [&](const Tensor& p, const float* values) { fn(p, 0, p.numel(), values); });
  };
  const io::ExportStats stats = io::export_weights(path, z.model, o);
  int64_t largest = 0, total = 0;
  for (size_t u = 0; u < z.sharded.num_units(); ++u) {
    int64_t n = 0;
    for (const Tensor& p : z.sharded.unit_params(u)) n += p.numel() * 4;
    largest = std::max(largest, n);
    total += n;
  }
  EXPECT_GT(stats.max_held_bytes, 0);
  EXPECT_LE(stats.max_held_bytes, largest) << "of " << total << " bytes in all";
  EXPECT_LT(largest * 4, total);
  nn::GPT reloaded(cfg, 99);
  io::load_weights(path, reloaded);
  EXPECT_EQ(whole_values(z), unit_order_values(reloaded));
}

// The trainer with dist.zero = 3 on one rank: the losses and the exported weights of plain
// training, bit for bit (with accumulation, bf16 gathers, recomputation); what ZeRO-3 does not
// combine with yet is refused by name.
TEST(Zero3, TrainerOnOneRankEqualsPlainTraining) {
  auto run = [](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {
        "--model.n_layer=2",       "--model.d_model=32",    "--model.n_head=2",
        "--model.seq_len=16",      "--model.vocab_size=61", "--train.batch_size=4",
        "--train.steps=4",         "--train.eval_every=2",  "--data.source=synthetic",
        "--log.progress=off",      "--log.jsonl=false",     "--log.tensorboard=false",
        "--log.save_weights=false"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::ostringstream out;
    train::TrainOptions o;
    o.write_run_dir = false;
    return train::run_training(train::load_config("", args), out, o);
  };
  const train::TrainResult a = run({}), b = run({"--dist.zero=3"});
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.val_losses, b.val_losses);
  // Accumulation, either way: on one rank the sharded gradient is the first micro-batch's, then
  // the second's added to it, the same additions as accumulating whole gradients.
  const train::TrainResult c = run({"--train.accum_steps=3"});
  for (const std::string sharded : {"true", "false"}) {
    const train::TrainResult d =
        run({"--train.accum_steps=3", "--dist.zero=3", "--dist.accumulate_sharded=" + sharded});
    EXPECT_EQ(c.losses, d.losses) << "accumulate_sharded " << sharded;
  }
  // bf16: the products' weights gathered in bf16 are the values autocast casts them to, so the
  // losses are those of plain bf16 training too.
  const train::TrainResult e = run({"--train.precision=bf16"});
  for (const std::string gather : {"fp32", "bf16"}) {
    const train::TrainResult f =
        run({"--train.precision=bf16", "--dist.zero=3", "--dist.gather_dtype=" + gather});
    EXPECT_EQ(e.losses, f.losses) << "bf16, gathers in " << gather;
    EXPECT_EQ(e.val_losses, f.val_losses) << "bf16, gathers in " << gather;
  }
  // Recomputation: a replayed block's forward unpacks its parameters through ZeRO-3's hooks,
  // which gather the unit again (on demand with prefetch 0, or already whole); both policies,
  // LLaMA untied too, and with bf16 gathers. The replay makes the same bits.
  for (const std::string policy : {"full", "selective"}) {
    for (const std::string prefetch : {"0", "1"}) {
      const std::string what = policy + ", prefetch " + prefetch;
      const std::vector<std::string> z3 = {"--dist.zero=3", "--dist.prefetch=" + prefetch,
                                           "--train.recompute=" + policy};
      EXPECT_EQ(a.losses, run(z3).losses) << what;
      std::vector<std::string> llama = {"--model.family=llama", "--model.tie_embeddings=false"};
      const train::TrainResult plain_llama = run(llama);
      llama.insert(llama.end(), z3.begin(), z3.end());
      EXPECT_EQ(plain_llama.losses, run(llama).losses) << "llama, " << what;
      std::vector<std::string> bf16 = {"--train.precision=bf16", "--dist.gather_dtype=bf16"};
      bf16.insert(bf16.end(), z3.begin(), z3.end());
      EXPECT_EQ(e.losses, run(bf16).losses) << "bf16 gathers, " << what;
    }
  }
  for (const std::string bad : {"--dist.gather_dtype=bf16"}) {
    try {
      (void)train::load_config("", {"--dist.zero=3", bad});
      ADD_FAILURE() << bad << " was accepted with dist.zero = 3";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("dist.zero = 3"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace kuai::dist
