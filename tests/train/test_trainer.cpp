// The training loop's techniques against their plain versions: k micro-batches equal one batch of
// k*b (gradients, loss and the parameters after an AdamW step) in the activation memory of one
// micro-batch; the run directory holds config, JSONL and TensorBoard events that agree with the
// losses; evaluation runs on the held-out split; a stop request ends the run cleanly.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "kuai/core/allocator.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/data/token_file.h"
#include "kuai/io/tensor_io.h"
#include "kuai/log/event_writer.h"
#include "kuai/optim/adamw.h"
#include "kuai/train/trainer.h"

namespace kuai::train {
namespace {

nn::GPTConfig small_model() {
  nn::GPTConfig c;
  c.vocab_size = 64;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 32;
  c.seq_len = 32;
  return c;
}

// Rows [r0, r0 + n) of (B, T) int32 `t`.
Tensor rows(const Tensor& t, int64_t r0, int64_t n) { return contiguous(narrow(t, 0, r0, n)); }

// Tolerance for sums of the same fp32 terms in another grouping (k partial sums vs one):
// |a - b| <= 1e-6 + 1e-5 |b|.
void expect_close(const Tensor& a, const Tensor& b, const std::string& what) {
  const auto va = a.to_vector<float>(), vb = b.to_vector<float>();
  ASSERT_EQ(va.size(), vb.size()) << what;
  for (size_t i = 0; i < va.size(); ++i)
    ASSERT_LE(std::fabs(va[i] - vb[i]), 1e-6 + 1e-5 * std::fabs(vb[i])) << what << " [" << i << "]";
}

TEST(Accumulation, MicroBatchesEqualOneLargeBatch) {
  const nn::GPTConfig cfg = small_model();
  const int64_t k = 4, b = 2, T = cfg.seq_len;
  Generator g(7, 0);
  const Tensor x = g.randint({k * b, T}, 0, static_cast<int32_t>(cfg.vocab_size));
  const Tensor y = g.randint({k * b, T}, 0, static_cast<int32_t>(cfg.vocab_size));

  nn::GPT big(cfg, 1), acc(cfg, 1);  // same seed: same weights
  const float big_loss = forward_backward(big, x, y, 1.0f).item();
  float acc_loss = 0.0f;
  for (int64_t i = 0; i < k; ++i)
    acc_loss += forward_backward(acc, rows(x, i * b, b), rows(y, i * b, b), 1.0f / k).item() / k;
  EXPECT_NEAR(acc_loss, big_loss, 1e-6 + 1e-5 * std::fabs(big_loss));

  const auto pb = big.named_parameters(), pa = acc.named_parameters();
  for (size_t i = 0; i < pb.size(); ++i)
    expect_close(pa[i].second.grad(), pb[i].second.grad(), pb[i].first);

  // One AdamW step from those gradients gives the same parameters.
  optim::AdamW ob(param_groups(big, 0.1f), {}), oa(param_groups(acc, 0.1f), {});
  ob.step();
  oa.step();
  for (size_t i = 0; i < pb.size(); ++i) expect_close(pa[i].second, pb[i].second, pb[i].first);
}

TEST(Accumulation, PeakMemoryIsThatOfOneMicroBatch) {
  nn::GPTConfig cfg = small_model();
  cfg.seq_len = 64;
  const int64_t k = 4, b = 4, T = cfg.seq_len;
  Generator g(3, 0);
  const Tensor x = g.randint({k * b, T}, 0, static_cast<int32_t>(cfg.vocab_size));
  const Tensor y = g.randint({k * b, T}, 0, static_cast<int32_t>(cfg.vocab_size));
  auto peak_of = [&](int64_t micro_rows, int64_t micro_batches) {
    nn::GPT m(cfg, 1);
    // Gradients exist from an earlier step, as in training (accumulation adds into them).
    forward_backward(m, rows(x, 0, 1), rows(y, 0, 1), 1.0f);
    Allocator::get().reset_peak();
    const int64_t base = Allocator::get().stats().current;
    for (int64_t i = 0; i < micro_batches; ++i)
      forward_backward(m, rows(x, i * micro_rows, micro_rows), rows(y, i * micro_rows, micro_rows),
                       1.0f / static_cast<float>(micro_batches));
    return Allocator::get().stats().peak - base;  // activations and temporaries above the model
  };
  const double one_b = static_cast<double>(peak_of(b, 1));
  const double k_of_b = static_cast<double>(peak_of(b, k));
  const double one_kb = static_cast<double>(peak_of(k * b, 1));
  EXPECT_GT(one_kb, 2.5 * one_b) << "the workload must be activation-dominated for this test";
  EXPECT_LE(k_of_b, 1.1 * one_b);
}

std::string periodic_corpus(int64_t n) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>("kuai trains fast. "[i % 18]);
  const auto path = (std::filesystem::temp_directory_path() / "kuai_trainer_corpus.bin").string();
  data::write_token_file(path, tokens.data(), n, 1);
  return path;
}

// The same through the trainer's own loop (loader, loss / k, the step once per k micro-batches):
// batch b with k micro-batches trains like batch k*b, step after step (losses within the
// regrouping tolerance over 6 AdamW steps, with 2 loader workers).
class AccumulationLoop : public ::testing::TestWithParam<std::string> {};  // model.family

TEST_P(AccumulationLoop, TheTrainersLoopEqualsOneBatchOfKTimesB) {
  const std::string corpus = periodic_corpus(8000);
  auto losses = [&](int64_t batch, int64_t k) {
    std::vector<std::string> args = {"--model.n_layer=1",
                                     "--model.d_model=32",
                                     "--model.n_head=2",
                                     "--model.seq_len=16",
                                     "--train.batch_size=" + std::to_string(batch),
                                     "--train.accum_steps=" + std::to_string(k),
                                     "--train.steps=6",
                                     "--train.eval_every=0",
                                     "--train.log_every=1",
                                     "--train.warmup_steps=0",
                                     "--train.lr=3e-3",
                                     "--data.workers=2",
                                     "--data.path=" + corpus,
                                     "--model.family=" + GetParam()};
    if (GetParam() == "llama") args.push_back("--model.n_kv_head=1");
    const TrainConfig c = load_config("", args);
    TrainOptions o;
    o.write_run_dir = false;
    std::ostringstream out;
    return run_training(c, out, o);
  };
  // Losses and the gradient norms (AdamW and clipping would hide gradients k times too large).
  const TrainResult one = losses(8, 1);
  ASSERT_EQ(one.losses.size(), 6u);
  ASSERT_EQ(one.grad_norms.size(), 6u);
  for (int64_t k : {2, 4}) {
    const TrainResult acc = losses(8 / k, k);
    ASSERT_EQ(acc.losses.size(), one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i) {
      EXPECT_NEAR(acc.losses[i], one.losses[i], 1e-6 + 1e-5 * std::fabs(one.losses[i]))
          << "k " << k << " step " << i + 1;
      EXPECT_NEAR(acc.grad_norms[i], one.grad_norms[i], 1e-6 + 1e-5 * std::fabs(one.grad_norms[i]))
          << "k " << k << " step " << i + 1;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Family, AccumulationLoop, ::testing::Values("gpt2", "llama"));

TEST(Trainer, RunDirectoryHoldsConfigMetricsEventsAndWeights) {
  const auto dir = std::filesystem::temp_directory_path() / "kuai_runs_test";
  std::filesystem::remove_all(dir);
  const TrainConfig c = load_config(
      "", {"--run.name=t1", "--run.dir=" + dir.string(), "--model.n_layer=1", "--model.d_model=32",
           "--model.n_head=2", "--model.seq_len=16", "--train.batch_size=4", "--train.steps=12",
           "--train.accum_steps=2", "--train.eval_every=5", "--train.eval_batches=2",
           "--train.log_every=4", "--data.workers=2", "--data.path=" + periodic_corpus(6000)});
  std::ostringstream out;
  const TrainResult r = run_training(c, out);
  ASSERT_EQ(r.losses.size(), 12u);
  ASSERT_EQ(r.run_path, (dir / "t1").string());
  // Held-out loss at steps 5, 10 and the last one.
  ASSERT_EQ(r.val_losses.size(), 3u);
  EXPECT_EQ(r.val_losses[0].first, 5);
  EXPECT_EQ(r.val_losses[2].first, 12);
  EXPECT_TRUE(std::isfinite(r.val_losses[2].second));

  EXPECT_EQ(to_toml(load_config(r.run_path + "/config.toml", {})), to_toml(c));
  std::ifstream jsonl(r.run_path + "/metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(jsonl, line)) ++lines;
  EXPECT_EQ(lines, 12);

  std::string events;
  for (const auto& e : std::filesystem::directory_iterator(r.run_path))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) events = e.path();
  ASSERT_FALSE(events.empty());
  int losses = 0, vals = 0;
  for (const log::ScalarEvent& e : log::read_scalar_events(events)) {
    if (e.tag == "train/loss") {
      ASSERT_GE(e.step, 1);
      EXPECT_EQ(e.value, r.losses[static_cast<size_t>(e.step - 1)]);
      ++losses;
    }
    if (e.tag == "val/loss") ++vals;
  }
  EXPECT_EQ(losses, 12);
  EXPECT_EQ(vals, 3);
  EXPECT_EQ(io::load_safetensors(r.run_path + "/model.safetensors").size(),
            nn::GPT(c.model, 0).named_parameters().size());
}

TEST(Trainer, StopRequestEndsAfterTheCurrentStep) {
  TrainConfig c = load_config(
      "", {"--model.n_layer=1", "--model.d_model=16", "--model.n_head=2", "--model.seq_len=8",
           "--train.batch_size=2", "--train.steps=50", "--data.source=synthetic"});
  const std::atomic<bool>* flag = install_sigint_stop();
  std::raise(SIGINT);  // as Ctrl-C would
  std::signal(SIGINT, SIG_DFL);
  ASSERT_TRUE(flag->load());
  TrainOptions o;
  o.write_run_dir = false;
  o.stop = flag;
  std::ostringstream out;
  const TrainResult r = run_training(c, out, o);
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.steps_done, 0);
  EXPECT_NE(out.str().find("interrupted: stopped cleanly after step 0"), std::string::npos);
}

// Technique 10, counted: Tensor::item() is a host read on its own thread only; fp32, bf16 and
// fp16 steps make none (the metrics and the fp16 scale stay on the device), and the per-step
// .item() habit that `log.sync_every_step` reproduces shows as one per step. The RESULT line
// carries the measured fields.
TEST(HostReads, ItemCountsOnTheCallingThreadOnly) {
  const Tensor t = full({}, 3.0f);
  const int64_t mine = host_reads_this_thread(), total = host_reads_total();
  EXPECT_EQ(t.item(), 3.0f);
  EXPECT_EQ(host_reads_this_thread(), mine + 1);
  EXPECT_GE(host_reads_total(), total + 1);
  int64_t other = -1;
  std::thread([&] { other = host_reads_this_thread(); }).join();
  EXPECT_EQ(other, 0);
}

TEST(HostReads, Fp32Bf16AndFp16StepsReadNothingOnTheHost) {
  for (const std::string precision : {"fp32", "bf16", "fp16"}) {
    for (const bool sync_every_step : {false, true}) {
      const TrainConfig c = load_config(
          "", {"--model.n_layer=1", "--model.d_model=16", "--model.n_head=2", "--model.seq_len=8",
               "--train.batch_size=2", "--train.steps=6", "--train.log_every=2",
               "--data.source=synthetic", "--train.precision=" + precision,
               std::string("--log.sync_every_step=") + (sync_every_step ? "true" : "false")});
      TrainOptions o;
      o.write_run_dir = false;
      std::ostringstream out;
      const TrainResult r = run_training(c, out, o);
      EXPECT_EQ(r.host_reads_per_step, sync_every_step ? 1.0 : 0.0)
          << precision << " sync_every_step " << sync_every_step;
      EXPECT_EQ(r.comm_mib_per_step, 0.0);  // one process: no collective
      const std::string line = result_line(r);
      EXPECT_NE(line.find(sync_every_step ? " host_reads_per_step=1 " : " host_reads_per_step=0 "),
                std::string::npos)
          << line;
      EXPECT_NE(line.find(" comm_mib_per_step=0.000 overlap=0.000"), std::string::npos) << line;
    }
  }
}

}  // namespace
}  // namespace kuai::train
