// kuai plan against what it predicts (kuai/plan/): the step runs on meta tensors (plan/trace.h)
// and its ops are priced as measured here (plan/costs.h).
//   - the predicted peak of live tensors is the trainer's measured peak within 5% on configs of
//     both families, fp32, bf16 and fp16, accumulation, flash and naive attention, with the
//     table of saved tensors naming what each attention keeps (the probabilities for naive, the
//     logsumexp for flash);
//   - a model the planner was not written for (a GPT with parallel attention and SiLU MLP blocks
//     built from kuai's modules and ops) is planned: its peak is what the same TrainStep takes
//     on the CPU within 5%, and its step's FLOPs are its products' textbook count;
//   - an op is timed beside other ranks' copies of it, and they leave nothing allocated;
//   - the time model's arithmetic (ring all-reduce, a bucket launched during backward against
//     one launched after it, a scalar never waited for, a gather waited for by its reader);
//   - ZeRO-3's gathers are waited for where their units run, ahead of them with prefetch;
//   - --fit on a config predicted 2x over a budget returns change sets, and the fastest
//     single-process one, run for 3 steps, peaks within the budget;
//   - the command-line units are parsed or refused by name.
// The 2-rank configs (DDP, ZeRO-1, ZeRO-2, compression) are checked in tests/mpi/test_mpi.cpp.
#include <gtest/gtest.h>
#include <omp.h>

#include <set>
#include <sstream>

#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"
#include "kuai/nn/gpt.h"
#include "kuai/nn/layers.h"
#include "kuai/plan/plan.h"
#include "kuai/train/step_parts.h"
#include "kuai/train/trainer.h"

namespace kuai {
namespace {

std::vector<std::string> small(std::vector<std::string> extra) {
  std::vector<std::string> a = {
      "--data.source=synthetic", "--model.n_layer=2",       "--model.d_model=64",
      "--model.n_head=4",        "--model.seq_len=64",      "--train.batch_size=4",
      "--train.steps=3",         "--train.eval_every=0",    "--log.progress=off",
      "--log.jsonl=false",       "--log.tensorboard=false", "--log.save_weights=false"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

int64_t measured_peak(const train::TrainConfig& cfg) {
  Allocator::get().empty_cache();  // no blocks cached by earlier tests to reuse (and count)
  train::TrainOptions o;
  o.write_run_dir = false;
  o.quiet = true;
  std::ostringstream out;
  return train::run_training(cfg, out, o).peak_alloc_bytes;
}

plan::Link test_link() {
  plan::Link l;
  l.bandwidth_gbs = 10;
  l.latency_us = 10;
  l.source = "test";
  return l;
}

class PlanPeak : public ::testing::TestWithParam<std::vector<std::string>> {};

TEST_P(PlanPeak, IsTheTrainersMeasuredPeakWithin5Percent) {
  plan::set_quick_measurements(true);
  const train::TrainConfig cfg = train::load_config("", small(GetParam()));
  plan::MachineCosts costs;
  const plan::Prediction p = plan::predict(cfg, 1, int64_t{1} << 40, test_link(), costs);
  const int64_t measured = measured_peak(cfg);
  const double ratio = double(p.step.peak_bytes) / double(measured);
  EXPECT_NEAR(ratio, 1.0, 0.05) << "predicted " << p.step.peak_bytes << " measured " << measured
                                << " at " << p.step.peak_where;
  // What the attention keeps for backward, by name: naive attention its (B, H, T, T)
  // probabilities (output 1), flash its logsumexp (output 1, B x H x T floats).
  const train::TrainConfig& c = cfg;
  const int64_t heads = c.model.n_head, T = c.model.seq_len, B = c.batch_size;
  int64_t probabilities = 0, lse = 0;
  for (const plan::SavedRow& r : p.step.saved) {
    if (r.what.rfind("attention output 1", 0) == 0) probabilities += r.bytes;
    if (r.what.rfind("flash_attention output 1", 0) == 0) lse += r.bytes;
  }
  // Recomputed blocks keep neither (selective keeps flash's lse, a product of attention).
  const int64_t plain = c.model.n_layer - p.spec.recompute_layers;
  if (p.spec.flash) {
    EXPECT_EQ(probabilities, 0);
    EXPECT_EQ(lse, (p.spec.recompute == "selective" ? c.model.n_layer : plain) *
                       int64_t(Allocator::round_size(size_t(B * heads * T * 4))));
  } else {
    EXPECT_EQ(lse, 0);
    EXPECT_GE(probabilities, plain * B * heads * T * T * 2);
    if (plain == 0) {
      EXPECT_EQ(probabilities, 0);
    }
  }
  EXPECT_GT(p.time.step_s, 0.0);
  plan::set_quick_measurements(false);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, PlanPeak,
    ::testing::Values(
        std::vector<std::string>{}, std::vector<std::string>{"--train.precision=bf16"},
        std::vector<std::string>{"--train.precision=fp16", "--train.accum_steps=3"},
        std::vector<std::string>{"--model.attention=flash", "--model.seq_len=128"},
        std::vector<std::string>{"--model.family=llama", "--model.n_kv_head=2",
                                 "--model.attention=flash"},
        std::vector<std::string>{"--model.family=llama", "--train.precision=bf16",
                                 "--train.accum_steps=2", "--data.workers=0"},
        std::vector<std::string>{"--model.family=llama", "--model.vocab_size=1000",
                                 "--model.tie_embeddings=true", "--train.batch_size=8"},
        // Compiled: the step captured on meta, replayed in its planned arena.
        std::vector<std::string>{"--train.compile=true", "--train.batch_size=8"},
        std::vector<std::string>{"--train.compile=true", "--model.family=llama",
                                 "--train.precision=bf16", "--train.accum_steps=2",
                                 "--model.attention=flash"},
        // Activation recomputation: the replay's tensors are the step's own.
        std::vector<std::string>{"--train.recompute=full", "--train.accum_steps=2"},
        std::vector<std::string>{"--model.family=llama", "--train.precision=bf16",
                                 "--train.recompute=selective", "--model.attention=flash",
                                 "--train.recompute_layers=1"},
        std::vector<std::string>{"--train.compile=true", "--train.recompute=full",
                                 "--train.batch_size=8"},
        // Offloaded moments: the chunk buffers instead of the moments.
        std::vector<std::string>{"--train.offload=disk", "--train.offload_chunk_mb=1",
                                 "--model.d_model=128", "--train.offload_dir=/tmp/kuai_plan_off"},
        std::vector<std::string>{"--train.offload=disk", "--train.recompute=full",
                                 "--train.precision=bf16", "--model.family=llama",
                                 "--train.offload_dir=/tmp/kuai_plan_off"}));

// What offload keeps resident, on meta: the moments' 8 bytes per parameter become six chunk
// buffers (smaller chunks, smaller buffers), and the update is priced at the disk's bandwidth.
// The 1.8 B LLaMA config (configs/llama-1.8b-offload.toml) fits this machine's 24 GiB only with
// its moments offloaded.
TEST(Plan, OffloadedMomentsAreTheChunkBuffersAndTheDiskPricesTheUpdate) {
  plan::set_quick_measurements(true);
  auto cfg = [](std::vector<std::string> extra) {
    extra.push_back("--model.d_model=128");
    return train::load_config("", small(extra));
  };
  const int64_t moments = [&] {
    const train::TrainConfig c = cfg({});
    const DeviceGuard meta(kMeta);
    return 8 * nn::GPT(c.model, 0).num_parameters();
  }();
  auto persistent = [](const plan::StepTrace& t) {
    return t.persistent[static_cast<size_t>(MemoryUse::kOptimizer)];
  };
  const plan::StepTrace in_memory = plan::trace_step(plan::target_for(cfg({}), 1));
  const plan::StepTrace one_mib = plan::trace_step(
      plan::target_for(cfg({"--train.offload=disk", "--train.offload_chunk_mb=1"}), 1));
  EXPECT_GE(persistent(in_memory), moments);
  EXPECT_LT(persistent(in_memory), moments + moments / 50);  // 16-float rounding per tensor
  EXPECT_EQ(persistent(one_mib), 6 << 20);
  EXPECT_LT(one_mib.peak_bytes, in_memory.peak_bytes - moments + (7 << 20));
  // The update's time: the longer of its disk I/O (both files read and written) and its memory.
  plan::MachineCosts costs;
  costs.disk.read_gbs = costs.disk.write_gbs = costs.disk.update_gbs = 0.001;  // 1 MB/s
  const plan::Prediction p = plan::predict_target(
      plan::target_for(cfg({"--train.offload=disk", "--train.offload_chunk_mb=1"}), 1),
      plan::step_spec(cfg({"--train.offload=disk"}), 1, 1), int64_t{1} << 40, test_link(), costs);
  EXPECT_NEAR(p.time.disk_s, 2.0 * double(moments) / 1e6, 0.01 * double(moments) / 1e6);
  // The demo's config: 16 bytes per parameter do not fit 24 GiB, 8 and the buffers do.
  const std::string demo = std::string(KUAI_SOURCE_DIR) + "/configs/llama-1.8b-offload.toml";
  const int64_t budget = int64_t{24} << 30;
  const plan::StepTrace with = plan::trace_step(plan::target_for(train::load_config(demo, {}), 1));
  const plan::StepTrace without =
      plan::trace_step(plan::target_for(train::load_config(demo, {"--train.offload=none"}), 1));
  EXPECT_LT(with.peak_bytes, int64_t{15} << 30);
  EXPECT_GT(without.peak_bytes, budget);
  plan::set_quick_measurements(false);
}

// Masters offloaded too (train.offload_master), on meta: the products' parameters are held in
// bf16 (2 bytes less each, and no weight casts in the step), the three files stream through nine
// chunk buffers, and the update is priced for all three files read and written.
TEST(Plan, OffloadedMastersHoldTheProductsInTheComputeDtype) {
  plan::set_quick_measurements(true);
  auto cfg = [](std::vector<std::string> extra) {
    for (const char* x : {"--model.d_model=128", "--train.precision=bf16", "--train.offload=disk",
                          "--train.offload_chunk_mb=1"})
      extra.push_back(x);
    return train::load_config("", small(extra));
  };
  int64_t products = 0, parameters = 0;
  {
    const DeviceGuard meta(kMeta);
    nn::GPT g(cfg({}).model, 0);
    parameters = g.num_parameters();
    for (const Tensor& p : nn::product_parameters(g)) products += p.numel();
  }
  ASSERT_GT(products, parameters / 2);
  auto persistent = [](const plan::StepTrace& t, MemoryUse u) {
    return t.persistent[static_cast<size_t>(u)];
  };
  const plan::StepTrace plain = plan::trace_step(plan::target_for(cfg({}), 1));
  const plan::StepTrace masters =
      plan::trace_step(plan::target_for(cfg({"--train.offload_master=true"}), 1));
  EXPECT_EQ(persistent(plain, MemoryUse::kOptimizer), 6 << 20);
  EXPECT_EQ(persistent(masters, MemoryUse::kOptimizer), 9 << 20);
  const int64_t saved =
      persistent(plain, MemoryUse::kParameters) - persistent(masters, MemoryUse::kParameters);
  EXPECT_NEAR(double(saved), 2.0 * double(products), 0.01 * double(products));
  // The peak: 2 bytes per product parameter held, 2 more of weight casts not made, the three
  // extra buffers back.
  EXPECT_LT(masters.peak_bytes, plain.peak_bytes - 3 * products + (3 << 20));
  plan::MachineCosts costs;
  costs.disk.read_gbs = costs.disk.write_gbs = costs.disk.update_gbs = 0.001;  // 1 MB/s
  const train::TrainConfig c = cfg({"--train.offload_master=true"});
  const plan::Prediction p = plan::predict_target(plan::target_for(c, 1), plan::step_spec(c, 1, 1),
                                                  int64_t{1} << 40, test_link(), costs);
  const double bytes = 2.0 * 12.0 * double(parameters);  // three files, read and written
  EXPECT_NEAR(p.time.disk_s, bytes / 1e6, 0.01 * bytes / 1e6);
  plan::set_quick_measurements(false);
}

TEST(Plan, RingAllReduceAndBucketOverlap) {
  plan::Link l;
  l.bandwidth_gbs = 2.0;
  l.latency_us = 5.0;
  const double b = 8e6;
  // 2(N-1)/N bytes / bandwidth + 2(N-1) latency; reduce-scatter and all-gather half of it.
  EXPECT_NEAR(l.seconds("all_reduce", b, 8), 2.0 * 7 / 8 * b / 2e9 + 14 * 5e-6, 1e-12);
  EXPECT_NEAR(l.seconds("reduce_scatter", b, 8), 7.0 / 8 * b / 2e9 + 7 * 5e-6, 1e-12);
  EXPECT_EQ(l.seconds("all_reduce", b, 1), 0.0);

  // Two backward ops of 10 ms, then the update (1 ms). A bucket of 40 MB (30 ms on 4 ranks)
  // launched after the first backward op runs beside the second and is waited for when backward
  // ends: 20 ms exposed. Launched after backward (no overlap) it is waited for at once: 30 ms.
  // A scalar launched with it is never waited for.
  plan::StepSpec spec;
  spec.ranks = 4;
  plan::MachineCosts costs;
  costs.bandwidth.points = {{1.0, 10.0}};
  auto op = [&](const std::string& key, bool backward, double seconds) {
    plan::OpRecord r;
    r.primitive = std::make_shared<Sum>(0, false);
    r.key = key;
    r.backward = backward;
    costs.ops[key] = {seconds, 0, "test"};
    return r;
  };
  plan::StepTrace step;
  step.tokens = 100;
  step.ops = {op("b1", true, 0.010), op("b2", true, 0.010), op("update", false, 0.001)};
  const double d = l.seconds("all_reduce", 4e7, 4);  // 30 ms
  const dist::CollectiveRecord scalar{"all_reduce", 4, DType::kF32, false};
  step.collectives = {{{"all_reduce", int64_t(4e7), DType::kF32, true}, 1}, {scalar, 3}};
  const plan::TimePrediction on = plan::predict_time(spec, step, costs, l);
  EXPECT_NEAR(on.comm_exposed_s, 0.010 + d - 0.020, 1e-9);
  EXPECT_NEAR(on.step_s, 0.010 + d + 0.001, 1e-9);
  EXPECT_NEAR(on.comm_s, d + l.seconds("all_reduce", 4, 4), 1e-9);
  step.collectives = {{{"all_reduce", int64_t(4e7), DType::kF32, false}, 2}, {scalar, 3}};
  const plan::TimePrediction off = plan::predict_time(spec, step, costs, l);
  EXPECT_NEAR(off.comm_exposed_s, d, 1e-9);
  EXPECT_NEAR(off.step_s - on.step_s, 0.010, 1e-9);
  EXPECT_NEAR(off.tokens_per_s, 400 / off.step_s, 1e-6);

  // An all_gather is waited for by the first op reading what it fills: a 15 ms gather launched
  // before two 10 ms forward ops and read by the second is hidden behind the first but 5 ms;
  // read by the third op (the update), it is hidden entirely.
  step.ops = {op("f1", false, 0.010), op("f2", false, 0.010), op("update", false, 0.001)};
  const double g = l.seconds("all_gather", 4e7, 4);  // 15 ms
  plan::CollectiveEvent gather{{"all_gather", int64_t(4e7), DType::kF32, false}, 0};
  gather.needed_at = 1;
  step.collectives = {gather};
  EXPECT_NEAR(plan::predict_time(spec, step, costs, l).comm_exposed_s, g - 0.010, 1e-9);
  step.collectives[0].needed_at = 2;
  EXPECT_NEAR(plan::predict_time(spec, step, costs, l).comm_exposed_s, 0.0, 1e-9);
  step.collectives[0].needed_at = plan::CollectiveEvent::kNever;  // waited for as it launches
  EXPECT_NEAR(plan::predict_time(spec, step, costs, l).comm_exposed_s, g, 1e-9);
}

// ZeRO-3 traced on 2 ranks: every unit's all_gather is waited for by an op that reads the unit's
// parameters, at or after its launch. Prefetched (dist.prefetch = 1), gathers are launched a
// unit's ops ahead of their reader, forward and backward; on demand (0), right before it. Over a
// slow link the prediction exposes less communication with prefetch than without.
TEST(Plan, Zero3GathersAreWaitedForWhereTheirUnitsRun) {
  plan::set_quick_measurements(true);
  plan::Link slow = test_link();
  slow.bandwidth_gbs = 0.05;
  double exposed[2] = {0, 0};
  for (int prefetch : {0, 1}) {
    const train::TrainConfig cfg = train::load_config(
        "", small({"--model.n_layer=4", "--model.tie_embeddings=false", "--dist.zero=3",
                   "--dist.prefetch=" + std::to_string(prefetch)}));
    plan::MachineCosts costs;
    const plan::Prediction p = plan::predict(cfg, 2, int64_t{1} << 40, slow, costs);
    size_t gathers = 0, ahead = 0;
    for (const plan::CollectiveEvent& e : p.step.collectives) {
      if (e.collective.op != "all_gather") continue;
      ++gathers;
      ASSERT_NE(e.needed_at, plan::CollectiveEvent::kNever) << "prefetch " << prefetch;
      EXPECT_GE(e.needed_at, e.at);
      if (e.needed_at > e.at + 3) ++ahead;
    }
    EXPECT_GE(gathers, 6u) << "prefetch " << prefetch;  // 6 units forward, again in backward
    if (prefetch == 0) {
      EXPECT_EQ(ahead, 0u);
    } else {
      EXPECT_GE(ahead, gathers / 2);
    }
    exposed[prefetch] = p.time.comm_exposed_s;
  }
  EXPECT_LT(exposed[1], exposed[0]);
  plan::set_quick_measurements(false);
}

// A GPT the planner was not written for: each block adds attention and a SiLU MLP computed side
// by side from one RMSNorm (a parallel block), qkv from one bias-free Linear.
class ParallelBlock final : public nn::Module {
 public:
  ParallelBlock(int64_t C, int64_t H, Generator& g) : H_(H) {
    norm_ = register_module("norm", std::make_shared<nn::RMSNorm>(C));
    qkv_ = register_module("qkv", std::make_shared<nn::Linear>(C, 3 * C, false, g));
    proj_ = register_module("proj", std::make_shared<nn::Linear>(C, C, false, g));
    up_ = register_module("up", std::make_shared<nn::Linear>(C, 3 * C, false, g));
    down_ = register_module("down", std::make_shared<nn::Linear>(3 * C, C, false, g));
  }
  Tensor forward(const Tensor& x) const {  // (B, T, C)
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), d = C / H_;
    const Tensor h = norm_->forward(x);
    std::vector<Tensor> q = split(reshape(qkv_->forward(h), {B, T, 3 * H_, d}), {H_, H_, H_}, 2);
    for (Tensor& t : q) t = transpose(t, 1, 2);
    const Tensor a =
        reshape(transpose(scaled_dot_product_attention(q[0], q[1], q[2], true), 1, 2), {B, T, C});
    return add(add(x, proj_->forward(a)), down_->forward(silu(up_->forward(h))));
  }

 private:
  int64_t H_;
  std::shared_ptr<nn::RMSNorm> norm_;
  std::shared_ptr<nn::Linear> qkv_, proj_, up_, down_;
};

class ParallelGPT final : public nn::Module {
 public:
  ParallelGPT(int64_t V, int64_t C, int64_t H, int64_t L, uint64_t seed) {
    Generator g(seed, 0);
    wte_ = register_module("wte", std::make_shared<nn::Embedding>(V, C, g));
    for (int64_t i = 0; i < L; ++i)
      blocks_.push_back(
          register_module("h." + std::to_string(i), std::make_shared<ParallelBlock>(C, H, g)));
    norm_ = register_module("norm", std::make_shared<nn::RMSNorm>(C));
    head_ = register_module("head", std::make_shared<nn::Linear>(C, V, false, g));
  }
  Tensor loss(const Tensor& x, const Tensor& y) const {
    Tensor h = wte_->forward(x);
    for (const auto& b : blocks_) h = b->forward(h);
    const Tensor logits = head_->forward(norm_->forward(h));
    const int64_t V = logits.size(2);
    return cross_entropy(reshape(logits, {-1, V}), reshape(y, {-1}));
  }

 private:
  std::shared_ptr<nn::Embedding> wte_;
  std::vector<std::shared_ptr<ParallelBlock>> blocks_;
  std::shared_ptr<nn::RMSNorm> norm_;
  std::shared_ptr<nn::Linear> head_;
};

TEST(Plan, AModelThePlannerWasNotWrittenForIsPlannedFromItsOwnStep) {
  plan::set_quick_measurements(true);
  static constexpr int64_t V = 97, C = 64, H = 4, L = 2, B = 4, T = 32, k = 2;
  train::StepOptions so;
  so.accum_steps = k;
  so.compute = DType::kBF16;
  auto build = [so](std::shared_ptr<dist::ProcessGroup>) {
    auto parts = std::make_unique<train::StepParts>();
    std::shared_ptr<ParallelGPT> m;
    {
      const MemoryUseScope params(MemoryUse::kParameters);
      m = std::make_shared<ParallelGPT>(V, C, H, L, 3);
    }
    parts->model = m;
    parts->adamw =
        std::make_unique<optim::AdamW>(train::param_groups(*m, 0.1f), optim::AdamWOptions{});
    parts->scaler = std::make_unique<amp::GradScaler>(
        amp::GradScalerOptions{65536.0f, 2.0f, 0.5f, 2000, false});
    ParallelGPT* raw = m.get();
    parts->step = std::make_unique<train::TrainStep>(
        *m, [raw](const Tensor& x, const Tensor& y) { return raw->loss(x, y); }, *parts->adamw,
        *parts->scaler, so);
    return parts;
  };
  plan::TraceTarget target;
  target.build = build;
  target.batch = B;
  target.seq = T;
  target.accum = k;
  plan::StepSpec spec;
  spec.batch = B;
  spec.seq = T;
  spec.accum = k;
  spec.compute = DType::kBF16;
  plan::MachineCosts costs;
  const plan::Prediction p =
      plan::predict_target(target, spec, int64_t{1} << 40, test_link(), costs);

  // The same parts on the CPU, two steps, the allocator's peak above what lived before.
  Allocator& a = Allocator::get();
  a.empty_cache();
  const int64_t before = a.stats().current;
  a.reset_peak();
  {
    auto parts = build(dist::single_process_group());
    Generator g(9, 0);
    const data::Batch batch{g.randint({B, T}, 0, V), g.randint({B, T}, 0, V)};
    for (int step = 0; step < 2; ++step) parts->step->step(std::vector<data::Batch>(k, batch));
  }
  const int64_t measured = a.stats().peak - before;
  EXPECT_NEAR(double(p.step.peak_bytes) / double(measured), 1.0, 0.05)
      << "predicted " << p.step.peak_bytes << " measured " << measured << " at "
      << p.step.peak_where;
  // Its FLOPs: 6 per matmul weight per token, and causal attention's 12 per query-key pair per
  // head dimension, read from the ops the step ran.
  const double weights = double(L * (3 * C * C + C * C + 2 * 3 * C * C) + C * V);
  const double pairs = double(T * (T + 1) / 2);
  EXPECT_NEAR(p.time.flops, 6 * weights * B * T * k + 12 * pairs * C * L * B * k, 1.0);
  EXPECT_GT(p.time.step_s, 0.0);
  // The saved naive attention probabilities, in bf16, by name.
  bool probabilities = false;
  for (const plan::SavedRow& r : p.step.saved)
    probabilities = probabilities || r.what.rfind("attention output 1 (bfloat16)", 0) == 0;
  EXPECT_TRUE(probabilities);
  plan::set_quick_measurements(false);
}

TEST(Plan, AnOpMeasuredBesideOtherRanksIsTimedAndLeavesNothing) {
  // The ranks of a run on one host run beside each other: each op is timed beside copies of it
  // on threads of their own (MachineCosts::neighbours), each on memory of its own. Every product
  // is timed that way, its scratch is measured, and what the neighbours held is given back.
  plan::set_quick_measurements(true);
  const plan::StepTrace t = plan::trace_step(
      plan::target_for(train::load_config("", small({"--train.precision=bf16"})), 1));
  std::set<std::string> seen;
  int64_t most = 0;
  Allocator& a = Allocator::get();
  for (const plan::OpRecord& op : t.ops) {
    if (op.view || op.primitive->op_class() != OpClass::kMatmul || !seen.insert(op.key).second)
      continue;
    const int64_t before = a.stats().current;
    const plan::OpCost beside = plan::measure_op(op, 2);
    EXPECT_EQ(a.stats().current, before) << op.key;
    EXPECT_EQ(beside.source, "measured") << op.key;
    EXPECT_GT(beside.seconds, 0.0) << op.key;
    most = std::max(most, beside.scratch);
  }
  EXPECT_GE(seen.size(), 3u);
  EXPECT_GT(most, 0);
  plan::set_quick_measurements(false);
}

TEST(Plan, FitOnAConfigTwiceOverBudgetRunsWithinIt) {
  plan::set_quick_measurements(true);
  const train::TrainConfig cfg = train::load_config(
      "", small({"--train.batch_size=8", "--model.seq_len=128", "--model.vocab_size=2000"}));
  plan::MachineCosts costs;
  const plan::Prediction p = plan::predict(cfg, 1, int64_t{1} << 40, test_link(), costs);
  const int64_t budget = p.step.peak_bytes / 2;
  const std::vector<plan::FitOption> options = plan::fit(cfg, 1, budget, test_link(), costs);
  ASSERT_FALSE(options.empty());
  const plan::FitOption* one = nullptr;
  bool recompute = false;  // proposed where the batch is kept
  for (const plan::FitOption& f : options) {
    EXPECT_LE(f.peak_bytes, budget);
    if (f.ranks == 1 && one == nullptr) one = &f;
    for (const std::string& o : f.overrides)
      recompute = recompute || o.starts_with("--train.recompute=");
  }
  EXPECT_TRUE(recompute);
  ASSERT_NE(one, nullptr);
  std::vector<std::string> args =
      small({"--train.batch_size=8", "--model.seq_len=128", "--model.vocab_size=2000"});
  args.insert(args.end(), one->overrides.begin(), one->overrides.end());
  const int64_t measured = measured_peak(train::load_config("", args));
  EXPECT_LE(measured, budget) << one->command("");
  plan::set_quick_measurements(false);
}

TEST(Plan, UnitsAreParsedOrRefusedByName) {
  EXPECT_EQ(plan::parse_bytes("64GiB", "--memory-per-rank"), int64_t{64} << 30);
  EXPECT_EQ(plan::parse_bytes("512 MiB", "--memory-per-rank"), int64_t{512} << 20);
  EXPECT_EQ(plan::parse_bytes("2e9", "--memory-per-rank"), int64_t{2000000000});
  EXPECT_DOUBLE_EQ(plan::parse_gbs("25GB/s", "--bandwidth"), 25.0);
  EXPECT_DOUBLE_EQ(plan::parse_gbs("100Gbit/s", "--bandwidth"), 12.5);
  EXPECT_DOUBLE_EQ(plan::parse_us("2ms", "--latency"), 2000.0);
  for (const char* bad : {"lots", "64 parsecs", "-1GiB"}) {
    try {
      plan::parse_bytes(bad, "--memory-per-rank");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--memory-per-rank"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace kuai
