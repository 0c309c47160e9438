// Multi-rank tests, run by ctest as `mpirun -np 2 kuai_mpi_tests` (see CMakeLists.txt): every
// rank runs every test; rank 0 prints the usual report, the others only failures.
//   - the MPI group's collectives against their definitions;
//   - DDP on 2 ranks x batch b equals one process with batch 2b: the averaged gradients match
//     the big batch's within 1e-5 of each tensor's scale (fp32, two summation orders of the same
//     mean) and the losses of 3 AdamW steps within 1e-5 relative; also with 2 micro-batches
//     (no_sync on the first); overlap on and off give the same gradients bit for bit;
//   - an unused parameter is an error on every rank, not a hang.
// Two more modes are separate ctest cases that must end the run with a message:
//   --timeout-demo  rank 1 never reaches a collective; rank 0 names it and aborts the run;
//   --kill-demo     rank 1 is killed (SIGKILL) mid-training; when mpirun ends rank 0, rank 0
//                   names rank 1 as the one that never reached the collective it waits on;
//   --exit-demo     the same with rank 1 exiting (_exit(3)) instead.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <cstdio>

#include <cmath>
#include <csignal>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <tuple>

#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/data/token_file.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/process_group.h"
#include "kuai/distributed/zero.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/plan/plan.h"
#include "kuai/train/checkpoint.h"
#include "kuai/train/step_parts.h"
#include "kuai/train/trainer.h"
#include "tests/mpi/expect_close.h"

namespace kuai::dist {
namespace {

std::shared_ptr<ProcessGroup> group() { return mpi_process_group(); }

TEST(MpiGroup, CollectivesMatchTheirDefinitions) {
  auto pg = group();
  const int R = pg->size(), r = pg->rank();
  ASSERT_EQ(R, 2) << "run under mpirun -np 2";
  // all_reduce: element i of rank r is r * 10 + i.
  Tensor t = zeros({5});
  for (int i = 0; i < 5; ++i) t.data<float>()[i] = static_cast<float>(r * 10 + i);
  Tensor a = t.clone();
  pg->all_reduce(a, ReduceOp::kSum)->wait();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a.data<float>()[i], 10.0f + 2 * i);
  a = t.clone();
  pg->all_reduce(a, ReduceOp::kAvg)->wait();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(a.data<float>()[i], 5.0f + i);
  // reduce_scatter: rank r gets elements [3 r, 3 r + 3) of the sum.
  Tensor in = zeros({6}), out = zeros({3});
  for (int i = 0; i < 6; ++i) in.data<float>()[i] = static_cast<float>(i * (r + 1));
  pg->reduce_scatter(in, out, ReduceOp::kSum)->wait();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(out.data<float>()[i], 3.0f * (3 * r + i));
  // A reduce-scatter larger than the group's pieces (4 MiB of input; mpi_process_group.cpp) runs
  // in pieces and gives every element its sum: fp32 with the average, and bf16 (each sum in fp32,
  // rounded once); hooks before the first piece and after the last. 2.5 pieces' worth, so the
  // last piece is short.
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t per_rank = (int64_t{5} << 20) / dtype_size(dt) / 2;  // elements of out
    Tensor values = zeros({per_rank * R});
    float* v = values.data<float>();
    for (int64_t i = 0; i < per_rank * R; ++i) v[i] = static_cast<float>((i % 100) * (r + 1));
    const Tensor big = cast(values, dt);  // exact in bf16 too (integers below 256)
    const Tensor part = zeros({per_rank}, dt);
    int before = 0, after = 0;
    pg->reduce_scatter(
          big, part, dt == DType::kF32 ? ReduceOp::kAvg : ReduceOp::kSum, [&] { ++before; },
          [&] { after += before; })
        ->wait();
    EXPECT_EQ(before, 1);
    EXPECT_EQ(after, 1);
    const std::vector<float> got = cast(part, DType::kF32).to_vector<float>();
    int64_t wrong = 0;
    for (int64_t i = 0; i < per_rank; ++i) {
      const float sum = 3.0f * static_cast<float>((r * per_rank + i) % 100);
      const float want = dt == DType::kF32 ? sum / 2 : bf16_to_float(float_to_bf16(sum));
      wrong += got[static_cast<size_t>(i)] != want;
    }
    EXPECT_EQ(wrong, 0) << dtype_name(dt);
  }
  // all_gather: rank r's block at [2 r, 2 r + 2).
  Tensor mine = full({2}, static_cast<float>(r + 1)), all = zeros({4});
  pg->all_gather(mine, all)->wait();
  EXPECT_EQ(all.to_vector<float>(), (std::vector<float>{1, 1, 2, 2}));
  // broadcast from rank 1.
  Tensor b = full({3}, static_cast<float>(r));
  pg->broadcast(b, 1)->wait();
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{1, 1, 1}));
  // Several in flight at once complete in order.
  std::vector<Tensor> many;
  std::vector<std::shared_ptr<Work>> works;
  for (int k = 0; k < 8; ++k) {
    many.push_back(full({1000}, static_cast<float>(k + r)));
    works.push_back(pg->all_reduce(many.back(), ReduceOp::kSum));
  }
  for (int k = 0; k < 8; ++k) {
    works[k]->wait();
    EXPECT_EQ(many[k].data<float>()[999], static_cast<float>(2 * k + 1));
  }
  pg->barrier();
  EXPECT_GT(pg->bytes_sent(), 8 * 4000);
}

nn::GPTConfig small() {
  nn::GPTConfig c;
  c.vocab_size = 61;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 32;
  c.seq_len = 16;
  return c;
}

double scaled_error(const std::vector<float>& got, const std::vector<float>& want) {
  double scale = 0, worst = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  return worst / (scale > 0 ? scale : 1.0);
}

// The global batch of step s: (2 b, T) tokens, the same on every rank; rank r's part is rows
// [r b, (r + 1) b).
struct Batch {
  Tensor x, y;
};
Batch global_batch(int64_t step, int64_t rows) {
  Generator g(100 + static_cast<uint64_t>(step), 0);
  return {g.randint({rows, 16}, 0, 61), g.randint({rows, 16}, 0, 61)};
}
Tensor rows_of(const Tensor& t, int64_t begin, int64_t n) {
  return contiguous(narrow(t, 0, begin, n));
}

// The trainer's arguments for small() on synthetic tokens, batch 4 per rank, no evaluation and no
// logs, then `extra`.
std::vector<std::string> small_run(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {
      "--model.n_layer=2",    "--model.d_model=32",      "--model.n_head=2",
      "--model.seq_len=16",   "--model.vocab_size=61",   "--train.batch_size=4",
      "--train.eval_every=0", "--data.source=synthetic", "--log.progress=off",
      "--log.jsonl=false",    "--log.tensorboard=false"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// The llama family on the same small shape: 4 query heads over 2 key/value heads, SwiGLU 48.
const std::vector<std::string> kLlama = {"--model.family=llama", "--model.n_head=4",
                                         "--model.n_kv_head=2", "--model.ffn_hidden=48"};

TEST(MpiDDP, TwoRanksOfBatchBEqualOneProcessOfBatch2B) {
  auto pg = group();
  const int64_t b = 4;
  for (int64_t micro : {1, 2}) {  // micro-batches per step (b / micro rows each)
    nn::GPT big(small(), 5), mine(small(), 5);
    optim::AdamWOptions ao;
    ao.lr = 1e-2f;
    optim::AdamW big_opt(train::param_groups(big, 0.1f), ao);
    optim::AdamW my_opt(train::param_groups(mine, 0.1f), ao);
    DistributedDataParallel ddp(mine, pg);
    for (int64_t step = 0; step < 3; ++step) {
      const Batch g = global_batch(step, 2 * b);
      Tensor big_loss = big.loss(g.x, g.y);
      big_loss.backward();
      ddp.zero_grad();
      float my_loss = 0;
      const int64_t rows = b / micro;
      for (int64_t m = 0; m < micro; ++m) {
        ddp.prepare_backward(m + 1 == micro);
        const int64_t at = pg->rank() * b + m * rows;
        const int64_t calls0 = pg->total_stats().calls;
        Tensor l = mine.loss(rows_of(g.x, at, rows), rows_of(g.y, at, rows));
        scale(l, 1.0f / static_cast<float>(micro)).backward();
        // no_sync: the micro-batches before the last launch no collective at all.
        if (m + 1 < micro)
          EXPECT_EQ(pg->total_stats().calls, calls0) << "no_sync micro-batch " << m;
        else
          EXPECT_GT(pg->total_stats().calls, calls0) << "the last micro-batch launched nothing";
        my_loss += l.item() / static_cast<float>(micro);
      }
      ddp.finish_backward();
      if (step == 0) {
        const auto bp = big.parameters(), mp = mine.parameters();
        for (size_t i = 0; i < bp.size(); ++i)
          EXPECT_LE(scaled_error(mp[i].grad().to_vector<float>(), bp[i].grad().to_vector<float>()),
                    1e-5)
              << "micro " << micro << " param " << i;
      }
      // The mean of the two ranks' losses is the big batch's loss.
      Tensor both = full({1}, my_loss);
      pg->all_reduce(both, ReduceOp::kAvg)->wait();
      EXPECT_NEAR(both.item(), big_loss.item(), 1e-5 * std::fabs(big_loss.item()))
          << "micro " << micro << " step " << step;
      big_opt.step();
      big_opt.zero_grad();
      my_opt.step();
    }
  }
}

// The averaged gradients, and the all-reduce bytes launched during backward and in all.
struct DdpGrads {
  std::vector<std::vector<float>> grads;
  int64_t in_backward = 0, sent = 0;
};
DdpGrads ddp_grads(bool overlap) {
  nn::GPT model(small(), 6);
  DDPOptions o;
  o.overlap = overlap;
  o.first_bucket_mb = 0.005;
  o.bucket_mb = 0.02;  // several buckets
  DistributedDataParallel ddp(model, group(), o);
  const Batch g = global_batch(0, 8);
  ddp.zero_grad();
  ddp.prepare_backward(true);
  const auto before = group()->stats(ProcessGroup::Collective::kAllReduce);
  model.loss(rows_of(g.x, group()->rank() * 4, 4), rows_of(g.y, group()->rank() * 4, 4)).backward();
  ddp.finish_backward();
  const auto after = group()->stats(ProcessGroup::Collective::kAllReduce);
  DdpGrads out;
  for (const Tensor& p : model.parameters()) out.grads.push_back(p.grad().to_vector<float>());
  out.in_backward = after.bytes_sent_in_backward - before.bytes_sent_in_backward;
  out.sent = after.bytes_sent - before.bytes_sent;
  return out;
}

// Overlap is the same arithmetic launched earlier: equal gradients; with overlap on, buckets are
// launched while backward still runs (all of them here, the last from the last hook), off none.
TEST(MpiDDP, OverlapLaunchesDuringBackwardAndGivesTheSameGradients) {
  const DdpGrads on = ddp_grads(true), off = ddp_grads(false);
  EXPECT_EQ(on.grads, off.grads);
  EXPECT_EQ(on.sent, off.sent);
  EXPECT_GT(on.sent, 0);
  EXPECT_EQ(on.in_backward, on.sent);
  EXPECT_EQ(off.in_backward, 0);
}

// The GPT plus one extra parameter (5 floats) that rank 1's loss never uses, or no rank's.
struct GptAndExtra : nn::Module {
  explicit GptAndExtra(nn::GPT& g) : extra(zeros({5})) {
    extra.requires_grad_();
    struct Holder : nn::Module {
      explicit Holder(Tensor e) { register_parameter("weight", e); }
    };
    register_module("gpt", std::shared_ptr<nn::GPT>(&g, [](nn::GPT*) {}));
    register_module("extra", std::make_shared<Holder>(extra));
  }
  Tensor extra;
};

TEST(MpiDDP, AnUnusedParameterIsAnErrorOnEveryRank) {
  nn::GPT model(small(), 7);
  GptAndExtra m(model);
  DistributedDataParallel ddp(m, group());
  const Batch g = global_batch(1, 8);
  ddp.zero_grad();
  ddp.prepare_backward(true);
  model.loss(rows_of(g.x, 0, 4), rows_of(g.y, 0, 4)).backward();
  try {
    ddp.finish_backward();
    ADD_FAILURE() << "expected an error on rank " << group()->rank();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("extra.weight"), std::string::npos) << e.what();
  }
  group()->barrier();  // both ranks got here: nothing hangs
}

// find_unused on 2 ranks, the extra parameter used by rank 0's loss only (its sum times 1):
// rank 1 contributes zero for it, so both ranks hold the average (1 + 0) / 2 = 0.5 in each
// element, and the GPT's gradients are the 2-rank average as without the extra parameter.
TEST(MpiDDP, FindUnusedAveragesAParameterOneRankDidNotUseAsZeroThere) {
  nn::GPT model(small(), 7), reference(small(), 7);
  GptAndExtra m(model);
  DDPOptions o;
  o.find_unused = true;
  DistributedDataParallel ddp(m, group(), o);
  DistributedDataParallel ref_ddp(reference, group());
  const Batch g = global_batch(2, 8);
  const Tensor x = rows_of(g.x, group()->rank() * 4, 4), y = rows_of(g.y, group()->rank() * 4, 4);
  for (int step = 0; step < 2; ++step) {  // twice: the skipped parameter's state resets
    ddp.zero_grad();
    ddp.prepare_backward(true);
    Tensor loss = model.loss(x, y);
    if (group()->rank() == 0) loss = add(loss, sum(m.extra));
    loss.backward();
    ddp.finish_backward();
    EXPECT_EQ(m.extra.grad().to_vector<float>(), std::vector<float>(5, 0.5f)) << "step " << step;
  }
  ref_ddp.zero_grad();
  ref_ddp.prepare_backward(true);
  reference.loss(x, y).backward();
  ref_ddp.finish_backward();
  const auto a = model.parameters(), b = reference.parameters();
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i].grad().to_vector<float>(), b[i].grad().to_vector<float>()) << "param " << i;
}

// The trainer on 2 ranks of batch b against one process (this rank, with a single-process group)
// of batch 2b on the same corpus: each rank's rows are its half of the big batch (RandomWindows
// shards by rank), so the logged losses (averaged over ranks) match the big batch's within 1e-4
// relative over 6 AdamW steps, with and without 2 micro-batches; the held-out loss too.
TEST(MpiTrainer, TwoRanksTrainLikeOneProcessWithTheDoubleBatch) {
  auto pg = group();
  std::vector<int32_t> tokens(20000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>("in the beginning kuai trains fast. "[i % 35]);
  const std::string path = fmt::format("/tmp/kuai_mpi_corpus_{}.bin", pg->rank());
  data::write_token_file(path, tokens.data(), static_cast<int64_t>(tokens.size()), 1);
  for (const char* accum : {"1", "2", "2 llama"}) {
    auto config = [&](int64_t batch) {
      std::vector<std::string> args = {"--model.n_layer=1",
                                       "--model.d_model=32",
                                       "--model.n_head=2",
                                       "--model.seq_len=16",
                                       fmt::format("--train.batch_size={}", batch),
                                       std::string("--train.accum_steps=") + accum[0],
                                       "--train.steps=6",
                                       "--train.eval_every=3",
                                       "--train.eval_batches=2",
                                       "--train.lr=3e-3",
                                       "--train.warmup_steps=0",
                                       "--data.workers=1",
                                       "--data.path=" + path,
                                       "--log.progress=off",
                                       "--log.jsonl=false",
                                       "--log.tensorboard=false",
                                       "--log.save_weights=false"};
      if (std::string(accum).ends_with("llama"))
        args.insert(args.end(), kLlama.begin(), kLlama.end());
      return train::load_config("", args);
    };
    std::ostringstream out;
    train::TrainOptions o;
    o.write_run_dir = false;
    o.group = pg;
    const train::TrainResult two = train::run_training(config(4), out, o);
    o.group = single_process_group();
    const train::TrainResult one = train::run_training(config(8), out, o);
    ASSERT_EQ(two.losses.size(), one.losses.size());
    for (size_t i = 0; i < one.losses.size(); ++i)
      EXPECT_NEAR(two.losses[i], one.losses[i], 1e-4 * std::fabs(one.losses[i]))
          << "accum " << accum << " step " << i + 1;
    ASSERT_EQ(two.val_losses.size(), 2u);
    EXPECT_NEAR(two.val_losses[1].second, one.val_losses[1].second,
                1e-4 * std::fabs(one.val_losses[1].second));
  }
}

// The trainer's counters on 2 ranks: no host read in a step in fp32, bf16 and fp16 (the loss is
// averaged by an all-reduce the logger waits for, the stop flag lives in host memory); the
// payload per step measured, halved by fp16 compression (all but the loss and the stop
// flag, 8 bytes); overlap near 1 with overlap on, 0 off.
TEST(MpiTrainer, CountersShowNoHostReadsHalvedPayloadAndOverlap) {
  auto pg = group();
  auto run = [&](const std::vector<std::string>& extra) {
    train::TrainOptions o;
    o.write_run_dir = false;
    o.group = pg;
    std::ostringstream out;
    return train::run_training(train::load_config("", small_run(extra)), out, o);
  };
  const train::TrainResult fp32 = run({"--train.steps=5"});
  const train::TrainResult bf16 = run({"--train.steps=5", "--train.precision=bf16"});
  const train::TrainResult fp16 = run({"--train.steps=5", "--train.precision=fp16"});
  const train::TrainResult half = run({"--train.steps=5", "--dist.compression=fp16"});
  const train::TrainResult off = run({"--train.steps=5", "--dist.overlap=false"});
  EXPECT_EQ(fp32.host_reads_per_step, 0.0);
  EXPECT_EQ(bf16.host_reads_per_step, 0.0);
  EXPECT_EQ(fp16.host_reads_per_step, 0.0);  // the scaler decides and updates on the device
  EXPECT_EQ(half.host_reads_per_step, 0.0);
  ASSERT_GT(fp32.comm_mib_per_step, 0.0);
  EXPECT_NEAR(half.comm_mib_per_step / fp32.comm_mib_per_step, 0.5, 0.01);
  EXPECT_EQ(off.comm_mib_per_step, fp32.comm_mib_per_step);
  EXPECT_GT(fp32.overlap, 0.99);  // every bucket from a hook; the loss and stop flag after
  EXPECT_EQ(off.overlap, 0.0);
  // In time: the share of the communication thread's all-reduce time that passed while
  // backward still ran. Off, the buckets start after backward (only the small loss all-reduce
  // can meet the next step's backward); on, most of their time is hidden behind it.
  std::printf("overlap_time: on %.3f (fp16 compression %.3f), off %.3f\n", fp32.overlap_time,
              half.overlap_time, off.overlap_time);
  EXPECT_GT(fp32.overlap_time, 0.0);
  EXPECT_GT(fp32.overlap_time, off.overlap_time);
  EXPECT_LT(off.overlap_time, 0.2);
  // That time per step: the collectives took some, on and off.
  EXPECT_GT(fp32.comm_ms_per_step, 0.0);
  EXPECT_GT(off.comm_ms_per_step, 0.0);
}

// train.compile on 2 ranks (technique 4 over technique 2): the captured step holds DDP's bucket
// all-reduces (started where backward's hooks started them, waited after backward) and zeroes the
// buckets, so every replay's averaged loss, gradient norm and the final weights equal the eager
// run's bit for bit, the lr schedule active: fp32, 2 micro-batches (no_sync on the first), fp16
// with its loss scaler, bf16 compression with error feedback, overlap off, ZeRO-1 and -2 (with
// accumulation, fp16, compression, offloaded moments); so do AdamW's moments
// (the full checkpoint's optimizer file, byte for byte). The replayed
// collectives are still launched during the (replayed) backward: overlap stays as eager's.
TEST(MpiTrainer, CompiledStepsEqualEagerBitForBit) {
  auto pg = group();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kuai_mpi_compile";
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"fp32", {}},
           {"accum2", {"--train.accum_steps=2"}},
           {"fp16", {"--train.precision=fp16"}},
           {"bf16_wire_feedback", {"--dist.compression=bf16", "--dist.error_feedback=true"}},
           {"overlap_off", {"--dist.overlap=false"}},
           {"llama", kLlama},
           {"llama_bf16_wire_accum2",
            {"--model.family=llama", "--model.n_head=4", "--model.n_kv_head=2",
             "--model.ffn_hidden=48", "--dist.compression=bf16", "--train.accum_steps=2"}},
           // ZeRO-1 and -2: their reduce-scatters, all-gathers, the norm's and the overflow
           // check's collectives are captured too; small buckets, so several are in flight and
           // the captured schedule releases them as it goes.
           {"zero1", {"--dist.zero=1", "--dist.bucket_mb=0.01", "--dist.first_bucket_mb=0.01"}},
           {"zero2", {"--dist.zero=2", "--dist.bucket_mb=0.01", "--dist.first_bucket_mb=0.01"}},
           {"zero2_accum2_fp16",
            {"--dist.zero=2", "--dist.bucket_mb=0.01", "--dist.first_bucket_mb=0.01",
             "--train.accum_steps=2", "--train.precision=fp16"}},
           {"zero2_bf16_wire_feedback",
            {"--dist.zero=2", "--dist.bucket_mb=0.01", "--dist.first_bucket_mb=0.01",
             "--dist.compression=bf16", "--dist.error_feedback=true"}},
           {"zero2_llama_fp16_wire_offload",
            {"--dist.zero=2", "--model.family=llama", "--model.n_head=4", "--model.n_kv_head=2",
             "--model.ffn_hidden=48", "--dist.compression=fp16", "--train.offload=disk"}}}) {
    auto run = [&](bool compiled) {
      std::vector<std::string> o = {
          "--train.steps=6",
          "--train.warmup_steps=2",
          "--checkpoint.save_every=6",
          "--train.log_every=1",
          "--train.threads=1",
          "--run.dir=" + dir.string(),
          "--run.name=" + name + (compiled ? "_compiled" : "_eager"),
          std::string("--train.compile=") + (compiled ? "true" : "false")};
      o.insert(o.end(), extra.begin(), extra.end());
      train::TrainOptions opts;
      opts.group = pg;
      std::ostringstream out;
      return train::run_training(train::load_config("", small_run(o)), out, opts);
    };
    // ZeRO-2's graph: bucket j's reduce-scatter is waited for (and its memory freed) by the time
    // bucket j + 3 starts, as the capture scheduled it (ddp.cpp: kInFlight), not all at the end.
    const std::string dump = (dir / fmt::format("{}_rank{}.graph", name, pg->rank())).string();
    std::filesystem::remove(dump);
    if (name == "zero2") setenv("KUAI_COMPILE_DUMP", dump.c_str(), 1);
    const train::TrainResult eager = run(false), compiled = run(true);
    unsetenv("KUAI_COMPILE_DUMP");
    if (name == "zero2") {
      std::ifstream f(dump);
      std::string line;
      int starts = 0, waits = 0;
      while (std::getline(f, line) && line.rfind("# graph 2", 0) != 0) {
        if (line.find(" reduce_scatter_start_ ") != std::string::npos) {
          EXPECT_GE(waits, starts - 2) << "bucket " << starts << ": " << line;
          ++starts;
        }
        if (line.find(" wait_ ") != std::string::npos) ++waits;
      }
      EXPECT_GE(starts, 6) << dump;
    }
    ASSERT_EQ(eager.losses.size(), 6u) << name;
    EXPECT_EQ(compiled.losses, eager.losses) << name;
    EXPECT_EQ(compiled.grad_norms, eager.grad_norms) << name;
    EXPECT_EQ(compiled.compile_captures, 1) << name;
    EXPECT_FALSE(compiled.compile_eager) << name;
    EXPECT_EQ(compiled.comm_mib_per_step, eager.comm_mib_per_step) << name;
    EXPECT_EQ(compiled.overlap, eager.overlap) << name;
    EXPECT_EQ(compiled.host_reads_per_step, 0.0) << name;
    if (pg->rank() == 0) {
      auto bytes = [](const std::string& path) {
        std::ifstream f(path, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
      };
      const std::string a = bytes(eager.run_path + "/model.safetensors");
      EXPECT_FALSE(a.empty()) << name;
      EXPECT_EQ(bytes(compiled.run_path + "/model.safetensors"), a) << name << ": final weights";
      // AdamW's moments and step count, from the full checkpoint of the last step.
      const std::string m = bytes(eager.run_path + "/ckpt-6/optimizer.rank0.safetensors");
      EXPECT_FALSE(m.empty()) << name;
      EXPECT_EQ(bytes(compiled.run_path + "/ckpt-6/optimizer.rank0.safetensors"), m)
          << name << ": optimizer state";
    }
    pg->barrier();
  }
}

// Activation recomputation (nn/checkpoint.h) on 2 ranks: DDP's grad-ready hooks fire from the
// same nodes in the same order, so losses, gradient norms, final weights and AdamW's state equal
// those of no recomputation bit for bit: with accumulation, fp16's scaler, bf16 and LLaMA, ZeRO-1
// and -2, no overlap, and compiled.
TEST(MpiTrainer, RecomputationTrainsBitForBitAsWithout) {
  auto pg = group();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kuai_mpi_recompute";
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"fp32_accum2", {"--train.accum_steps=2"}},
           {"fp16", {"--train.precision=fp16"}},
           {"llama_bf16",
            {"--model.family=llama", "--model.n_head=4", "--model.n_kv_head=2",
             "--model.ffn_hidden=48", "--train.precision=bf16"}},
           {"zero1_flash", {"--dist.zero=1", "--model.attention=flash"}},
           {"zero2_accum2", {"--dist.zero=2", "--train.accum_steps=2"}},
           {"overlap_off", {"--dist.overlap=false"}},
           {"compiled", {"--train.compile=true"}}}) {
    auto run = [&](const std::string& recompute) {
      std::vector<std::string> o = {"--train.steps=4",
                                    "--train.warmup_steps=2",
                                    "--checkpoint.save_every=4",
                                    "--train.threads=1",
                                    "--dist.bucket_mb=0.01",
                                    "--run.dir=" + dir.string(),
                                    "--run.name=" + name + "_" + recompute,
                                    "--train.recompute=" + recompute};
      o.insert(o.end(), extra.begin(), extra.end());
      train::TrainOptions opts;
      opts.group = pg;
      std::ostringstream out;
      return train::run_training(train::load_config("", small_run(o)), out, opts);
    };
    const train::TrainResult plain = run("none");
    ASSERT_EQ(plain.losses.size(), 4u) << name;
    for (const std::string policy : {"selective", "full"}) {
      const train::TrainResult r = run(policy);
      EXPECT_EQ(r.losses, plain.losses) << name << " " << policy;
      EXPECT_EQ(r.grad_norms, plain.grad_norms) << name << " " << policy;
      EXPECT_EQ(r.comm_mib_per_step, plain.comm_mib_per_step) << name << " " << policy;
      auto bytes = [](const std::string& path) {
        std::ifstream f(path, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
      };
      // Rank 0 writes the weights and AdamW's state; under ZeRO each rank its shard.
      std::vector<std::string> files;
      if (pg->rank() == 0) files = {"/model.safetensors", "/ckpt-4/optimizer.rank0.safetensors"};
      if (pg->rank() == 1 && name.starts_with("zero"))
        files = {"/ckpt-4/optimizer.rank1.safetensors"};
      for (const std::string& file : files) {
        const std::string a = bytes((dir / (name + "_none")).string() + file);
        EXPECT_FALSE(a.empty()) << name << file;
        EXPECT_EQ(bytes((dir / (name + "_" + policy)).string() + file), a)
            << name << " " << policy << file;
      }
    }
    pg->barrier();
  }
}

// Compression: the averaged gradients through fp16 / bf16 on the wire against the fp32 average,
// relative L2 error per tensor within fp16's 2^-10 and bf16's 2^-7 (two roundings of values
// below 1: measured well inside); half the bytes; error feedback keeps the residual.
TEST(MpiDDP, CompressedGradientsAreTheAverageWithinTheWireDtypesPrecision) {
  auto grads = [](Compression c, bool ef, int64_t* bytes) {
    nn::GPT model(small(), 9);
    DDPOptions o;
    o.compression = c;
    o.error_feedback = ef;
    DistributedDataParallel ddp(model, group(), o);
    const Batch g = global_batch(2, 8);
    ddp.zero_grad();
    ddp.prepare_backward(true);
    const int64_t sent0 = group()->stats(ProcessGroup::Collective::kAllReduce).bytes_sent;
    model.loss(rows_of(g.x, group()->rank() * 4, 4), rows_of(g.y, group()->rank() * 4, 4))
        .backward();
    ddp.finish_backward();
    *bytes = group()->stats(ProcessGroup::Collective::kAllReduce).bytes_sent - sent0;  // measured
    std::vector<std::vector<float>> out;
    for (const Tensor& p : model.parameters()) out.push_back(p.grad().to_vector<float>());
    return out;
  };
  int64_t full_bytes = 0, bytes = 0;
  const auto exact = grads(Compression::kNone, false, &full_bytes);
  for (auto [c, tol] :
       {std::pair{Compression::kFp16, 1.0 / 1024}, std::pair{Compression::kBf16, 1.0 / 128}}) {
    for (bool ef : {false, true}) {
      const auto got = grads(c, ef, &bytes);
      EXPECT_GT(full_bytes, 0);
      EXPECT_EQ(bytes * 2, full_bytes) << compression_name(c) << ": bytes handed to all_reduce";
      double worst = 0;
      for (size_t i = 0; i < exact.size(); ++i) {
        double num = 0, den = 0;
        for (size_t j = 0; j < exact[i].size(); ++j) {
          num += std::pow(static_cast<double>(got[i][j]) - exact[i][j], 2);
          den += std::pow(static_cast<double>(exact[i][j]), 2);
        }
        const double err = std::sqrt(num / std::max(den, 1e-30));
        worst = std::max(worst, err);
        EXPECT_LE(err, tol) << compression_name(c) << " ef " << ef << " param " << i;
      }
      // The wire dtype rounds: a cast that did nothing would leave the gradients exact.
      EXPECT_GT(worst, tol / 64) << compression_name(c) << " ef " << ef << ": no rounding seen";
    }
  }
}

// The default corpus, King James Bible bytes (scripts/setup.sh writes it; `make test` runs setup).
const data::TokenFile& kjv() {
  static const data::TokenFile f = [] {
    const std::string path = std::string(KUAI_SOURCE_DIR) + "/data/kjv.bin";
    if (!std::filesystem::exists(path))
      throw std::runtime_error(path + " is missing: run scripts/setup.sh");
    return data::TokenFile::open(path);
  }();
  return f;
}

// Rows of T + 1 bytes of KJV for (step, rank): rows spread over the whole book, different for
// every step and rank; x the first T, y the last T.
Batch kjv_batch(int64_t step, int rank, int64_t rows, int64_t T) {
  const data::TokenFile& f = kjv();
  std::vector<int32_t> x, y, w(static_cast<size_t>(T + 1));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t k = (step * 2 + rank) * rows + r;
    const int64_t at = (k * 104729) % (f.size() - T - 1);  // a prime stride through the book
    f.read(at, T + 1, w.data());
    x.insert(x.end(), w.begin(), w.end() - 1);
    y.insert(y.end(), w.begin() + 1, w.end());
  }
  return {from_vector(x, {rows, T}), from_vector(y, {rows, T})};
}

// Error feedback over 24 steps of KJV bytes, the parameters held fixed: each step's averaged
// gradient through bf16 on the wire, summed over the steps (the sum of the updates SGD would
// apply), against the exact fp32 sum, relative L2 error. Feedback carries each rank's cast error
// into its next step; the rounding of the sum on the wire, which no rank sees, stays. So:
//   - ranks on different rows (training): with feedback the error is smaller (measured 0.86x
//     here: the sum of two values rounds with about twice the error of each cast); bar 0.95x;
//   - ranks on the same rows: the wire sum of two equal bf16 values is exact, so with feedback
//     the summed error is one step's cast error while without it 24 steps' add up (measured
//     0.21x: one rounding against a random walk of 24, 1/sqrt(24)); bar 0.3x.
// Both are deterministic (fixed data and weights); the ratios are printed.
double summed_error_ratio(bool same_rows) {
  nn::GPTConfig c = small();
  c.vocab_size = 256;
  nn::GPT exact(c, 11), plain(c, 11), fed(c, 11);
  DDPOptions none, bf16, bf16_ef;
  bf16.compression = bf16_ef.compression = Compression::kBf16;
  bf16_ef.error_feedback = true;
  DistributedDataParallel d_exact(exact, group(), none), d_plain(plain, group(), bf16),
      d_fed(fed, group(), bf16_ef);
  const int64_t n = exact.num_parameters();
  std::vector<double> s_exact(n), s_plain(n), s_fed(n);
  auto add = [](nn::GPT& m, std::vector<double>& sum) {
    size_t k = 0;
    for (const Tensor& p : m.parameters())
      for (float v : p.grad().to_vector<float>()) sum[k++] += v;
  };
  for (int64_t step = 0; step < 24; ++step) {
    const Batch b = kjv_batch(step, same_rows ? 0 : group()->rank(), 4, 16);
    for (auto [m, d, sum] :
         {std::tuple{&exact, &d_exact, &s_exact}, std::tuple{&plain, &d_plain, &s_plain},
          std::tuple{&fed, &d_fed, &s_fed}}) {
      d->zero_grad();
      d->prepare_backward(true);
      m->loss(b.x, b.y).backward();
      d->finish_backward();
      add(*m, *sum);
    }
  }
  double e_plain = 0, e_fed = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    e_plain += std::pow(s_plain[i] - s_exact[i], 2);
    e_fed += std::pow(s_fed[i] - s_exact[i], 2);
    norm += s_exact[i] * s_exact[i];
  }
  e_plain = std::sqrt(e_plain / norm);
  e_fed = std::sqrt(e_fed / norm);
  if (group()->rank() == 0)
    std::printf(
        "[ note     ] %s rows: summed bf16 error over 24 steps %.3g without feedback, "
        "%.3g with (%.3fx)\n",
        same_rows ? "same" : "different", e_plain, e_fed, e_fed / e_plain);
  EXPECT_GT(e_plain, 0.0);
  return e_fed / e_plain;
}

TEST(MpiDDP, ErrorFeedbackKeepsTheSummedCompressedUpdatesNearTheExactSum) {
  EXPECT_LT(summed_error_ratio(false), 0.95);
  EXPECT_LT(summed_error_ratio(true), 0.3);
}

// Compressed training on KJV bytes (a learnable corpus, where a wrong update shows) follows
// uncompressed training: 60 AdamW steps on 2 ranks, the mean training loss of steps 51-60 (the
// same batches in every arm) within 0.1% of the uncompressed arm's, which must itself have
// learned (below 3.3 nats from ln 256 = 5.55). Measured here: fp16, bf16 and bf16 with error
// feedback differ by at most 0.001%, while one process on one rank's half batch (what a rank
// trains on when its all-reduce is skipped) differs by 1.0%.
std::vector<float> kjv_losses(const std::vector<std::string>& extra,
                              std::shared_ptr<ProcessGroup> pg) {
  std::vector<std::string> args = {"--model.n_layer=2",
                                   "--model.d_model=32",
                                   "--model.n_head=2",
                                   "--model.seq_len=32",
                                   "--train.batch_size=4",
                                   "--train.steps=60",
                                   "--train.lr=3e-3",
                                   "--train.warmup_steps=0",
                                   "--train.eval_every=0",
                                   "--data.workers=1",
                                   "--data.path=" + std::string(KUAI_SOURCE_DIR) + "/data/kjv.bin",
                                   "--log.progress=off",
                                   "--log.jsonl=false",
                                   "--log.tensorboard=false",
                                   "--log.save_weights=false"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::ostringstream out;
  train::TrainOptions o;
  o.write_run_dir = false;
  o.group = std::move(pg);
  return train::run_training(train::load_config("", args), out, o).losses;
}
double tail_mean(const std::vector<float>& l) {
  double s = 0;
  for (size_t i = l.size() - 10; i < l.size(); ++i) s += l[i];
  return s / 10;
}

TEST(MpiTrainer, CompressedTrainingFollowsUncompressed) {
  kjv();  // the corpus is there
  const double base = tail_mean(kjv_losses({"--dist.compression=none"}, group()));
  EXPECT_LT(base, 3.3);
  for (auto [comp, ef] :
       {std::pair{"fp16", false}, std::pair{"bf16", false}, std::pair{"bf16", true}}) {
    const double got =
        tail_mean(kjv_losses({std::string("--dist.compression=") + comp,
                              std::string("--dist.error_feedback=") + (ef ? "true" : "false")},
                             group()));
    EXPECT_NEAR(got, base, 1e-3 * base) << comp << " ef " << ef;
  }
}

// A 2-rank run stopped (every rank agrees on the step), checkpointed and resumed on 2 ranks gives
// the uninterrupted run's losses bit for bit: without ZeRO (rank 0 writes the checkpoint) and with
// ZeRO-2 (each rank writes its optimizer shard; the periodic save at step 3 is committed one step
// later, the stop's save at the end).
void resume_is_bit_exact(const std::string& zero, const std::vector<std::string>& extra = {}) {
  namespace fs = std::filesystem;
  auto pg = group();
  const fs::path dir = "/tmp/kuai_mpi_resume_zero" + zero + (extra.empty() ? "" : "_x");
  if (pg->rank() == 0) fs::remove_all(dir);
  pg->barrier();
  auto args = [&](const std::string& name) {
    std::vector<std::string> a = {"--run.dir=" + dir.string(), "--run.name=" + name,
                                  "--train.accum_steps=2",     "--train.steps=8",
                                  "--dist.zero=" + zero,       "--dist.bucket_mb=0.01",
                                  "--checkpoint.save_every=3"};
    a.insert(a.end(), extra.begin(), extra.end());
    return small_run(a);
  };
  std::ostringstream out;
  train::TrainOptions o;
  o.group = pg;
  const train::TrainResult full = train::run_training(train::load_config("", args("full")), out, o);
  ASSERT_EQ(full.losses.size(), 8u);
  EXPECT_EQ(full.save_failures, 0) << full.save_error;
  std::atomic<bool> stop{false};
  o.stop = &stop;
  o.after_step = [&](int64_t step) {
    if (step == 4) stop = true;
  };
  const train::TrainResult first = train::run_training(train::load_config("", args("cut")), out, o);
  ASSERT_TRUE(first.interrupted);
  const int64_t done = first.steps_done;  // the step every rank agreed to stop after
  ASSERT_GE(done, 4);
  ASSERT_LT(done, 8);
  pg->barrier();  // the checkpoint is in place
  train::TrainOptions r;
  r.group = pg;
  r.resume = (dir / "cut").string();
  const std::string ckpt = train::resolve_checkpoint(r.resume);
  EXPECT_EQ(fs::path(ckpt).filename(), fmt::format("ckpt-{}", done));
  const train::Checkpoint c = train::read_checkpoint(ckpt);
  EXPECT_EQ(c.world_size, zero == "0" ? 1 : 2);
  const train::TrainResult rest =
      train::run_training(train::load_config(ckpt + "/config.toml", {}), out, r);
  EXPECT_EQ(rest.start_step, done);
  std::vector<float> joined = first.losses;
  joined.insert(joined.end(), rest.losses.begin(), rest.losses.end());
  ASSERT_EQ(joined.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(joined[i], full.losses[i]) << "step " << i + 1;
  pg->barrier();
}

TEST(MpiTrainer, ResumeOfATwoRankRunIsBitExact) { resume_is_bit_exact("0"); }
TEST(MpiZero, ResumeOfATwoRankZero2RunIsBitExact) { resume_is_bit_exact("2"); }
// ZeRO-3: each rank writes its model shard too (no whole model anywhere) and restores it.
TEST(MpiZero3, ResumeOfATwoRankZero3RunIsBitExact) { resume_is_bit_exact("3"); }
// Each rank streams its offloaded shard into its optimizer file, and back into fresh files.
TEST(MpiZero, ResumeOfATwoRankZero2RunWithOffloadIsBitExact) {
  resume_is_bit_exact("2", {"--train.offload=disk"});
}
// With the masters offloaded too: the model file is gathered from both ranks' masters files as
// they stream (four 1 MiB rounds per rank), and each rank's shard of it streams back on resume.
TEST(MpiZero, ResumeOfATwoRankZero1RunWithOffloadedMastersIsBitExact) {
  resume_is_bit_exact(
      "1", {"--train.offload=disk", "--train.offload_master=true", "--train.precision=bf16",
            "--model.d_model=256", "--model.n_head=4", "--train.offload_chunk_mb=1"});
}

// Optimizer state offloaded to disk on 2 ranks (DDP: each rank all of it; ZeRO: each rank its
// shard, in a folder of its own), with or without the master weights, trains like the in-memory
// run bit for bit: losses, gradient norms, and the checkpoint's files (the offloaded save streams
// the same bytes, the model file from the masters).
TEST(MpiTrainer, OffloadTrainsBitForBitAsInMemory) {
  auto pg = group();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kuai_mpi_offload";
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"ddp_accum2", {"--train.accum_steps=2"}},
           {"ddp_fp16_full", {"--train.precision=fp16", "--train.recompute=full"}},
           {"zero1", {"--dist.zero=1"}},
           {"zero2_accum2_full",
            {"--dist.zero=2", "--train.accum_steps=2", "--train.recompute=full"}},
           {"zero2_llama_bf16",
            {"--dist.zero=2", "--model.family=llama", "--model.n_head=4", "--model.n_kv_head=2",
             "--model.ffn_hidden=48", "--train.precision=bf16"}},
           {"compiled", {"--train.compile=true"}},
           // The masters offloaded too (train.offload_master): each rank keeps them in its files.
           {"ddp_bf16_accum2_masters", {"--train.precision=bf16", "--train.accum_steps=2"}},
           {"compiled_fp16_full_masters",
            {"--train.compile=true", "--train.precision=fp16", "--train.recompute=full"}},
           // ZeRO: each rank its shard of the masters; the model file gathered from every rank's
           // masters file as they stream (several 1 MiB rounds: d_model 256).
           {"zero1_bf16_masters",
            {"--dist.zero=1", "--train.precision=bf16", "--model.d_model=256", "--model.n_head=4",
             "--train.offload_chunk_mb=1"}},
           {"zero2_fp16_accum2_full_masters",
            {"--dist.zero=2", "--train.precision=fp16", "--train.accum_steps=2",
             "--train.recompute=full", "--model.d_model=256", "--model.n_head=4",
             "--train.offload_chunk_mb=1"}},
           {"zero2_llama_bf16_masters",
            {"--dist.zero=2", "--model.family=llama", "--model.n_head=4", "--model.n_kv_head=2",
             "--model.ffn_hidden=48", "--train.precision=bf16"}}}) {
    const bool masters = name.ends_with("_masters");
    auto run = [&](const std::string& offload) {
      std::vector<std::string> o = {"--train.steps=4",
                                    "--train.warmup_steps=2",
                                    "--checkpoint.save_every=4",
                                    "--train.threads=1",
                                    "--dist.bucket_mb=0.01",
                                    "--run.dir=" + dir.string(),
                                    "--run.name=" + name + "_" + offload,
                                    "--train.offload=" + offload};
      if (masters && offload == "disk") o.push_back("--train.offload_master=true");
      o.insert(o.end(), extra.begin(), extra.end());
      train::TrainOptions opts;
      opts.group = pg;
      std::ostringstream out;
      return train::run_training(train::load_config("", small_run(o)), out, opts);
    };
    const train::TrainResult plain = run("none");
    const train::TrainResult r = run("disk");
    ASSERT_EQ(plain.losses.size(), 4u) << name;
    EXPECT_EQ(r.losses, plain.losses) << name;
    EXPECT_EQ(r.grad_norms, plain.grad_norms) << name;
    auto bytes = [](const std::string& path) {
      std::ifstream f(path, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    };
    std::vector<std::string> files;
    if (pg->rank() == 0)
      files = {"/model.safetensors", "/ckpt-4/model.safetensors",
               "/ckpt-4/optimizer.rank0.safetensors"};
    if (pg->rank() == 1 && name.starts_with("zero"))
      files = {"/ckpt-4/optimizer.rank1.safetensors"};
    for (const std::string& file : files) {
      const std::string a = bytes((dir / (name + "_none")).string() + file);
      EXPECT_FALSE(a.empty()) << name << file;
      EXPECT_EQ(bytes((dir / (name + "_disk")).string() + file), a) << name << file;
    }
    pg->barrier();
  }
}

// A run whose save at step 4 failed on rank 1 (checkpoint.on_error = stop): every rank stopped
// there, each says what it saw (rank 0 naming rank 1, rank 1 its own failure), and `latest` still
// names the complete checkpoint of step 2.
void expect_save_at_4_failed_everywhere(const train::TrainResult& r, dist::ProcessGroup& pg,
                                        const std::filesystem::path& run,
                                        const std::string& rank0_says,
                                        const std::string& rank1_says) {
  EXPECT_GE(r.save_failures, 1);
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.steps_done, 4);
  const std::string& says = pg.rank() == 0 ? rank0_says : rank1_says;
  EXPECT_NE(r.save_error.find(says), std::string::npos) << r.save_error;
  pg.barrier();
  const std::string latest = train::resolve_checkpoint(run.string());
  EXPECT_EQ(std::filesystem::path(latest).filename(), "ckpt-2");
  EXPECT_NO_THROW(train::read_checkpoint(latest));
  pg.barrier();
}

// A rank that cannot write its optimizer shard fails the checkpoint on every rank: rank 0 names
// it, every rank stops at the same step (checkpoint.on_error = stop), and `latest` still names
// the previous, complete checkpoint.
TEST(MpiZero, AShardThatCannotBeWrittenFailsTheCheckpointOnEveryRank) {
  namespace fs = std::filesystem;
  auto pg = group();
  const fs::path dir = "/tmp/kuai_mpi_efbig";
  if (pg->rank() == 0) fs::remove_all(dir);
  pg->barrier();
  std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead of killing
  rlimit saved{};
  getrlimit(RLIMIT_FSIZE, &saved);
  const train::TrainConfig cfg = train::load_config(
      "", small_run({"--run.dir=" + dir.string(), "--run.name=r", "--train.steps=6",
                     "--dist.zero=2", "--checkpoint.save_every=2", "--checkpoint.async=false",
                     "--checkpoint.on_error=stop", "--log.save_weights=false"}));
  train::TrainOptions o;
  o.group = pg;
  o.after_step = [&](int64_t step) {
    if (step == 2 && pg->rank() == 1) {
      rlimit r = saved;
      r.rlim_cur = 4096;  // rank 1's next shard cannot be written
      setrlimit(RLIMIT_FSIZE, &r);
    }
  };
  std::ostringstream out;
  const train::TrainResult r = train::run_training(cfg, out, o);
  setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, SIG_DFL);
  expect_save_at_4_failed_everywhere(r, *pg, dir / "r", "rank 1 could not write its shard",
                                     "optimizer.rank1.safetensors");
}

// `args` with ZeRO-1 and the masters offloaded in bf16, at a width whose shard streams in several
// 1 MiB chunks (the gather runs over several rounds).
std::vector<std::string> with_zero1_masters(std::vector<std::string> args) {
  for (const char* a : {"--dist.zero=1", "--train.offload=disk", "--train.offload_master=true",
                        "--train.precision=bf16", "--model.d_model=256", "--model.n_head=4",
                        "--train.offload_chunk_mb=1"})
    args.push_back(a);
  return args;
}

// With the masters offloaded, rank 0 gathers every rank's masters into the model file while the
// ranks stream their shards: a rank whose stream fails mid-save (an injected EIO on its first read
// of the save's pass) still takes part in the remaining rounds, so rank 0 does not wait for it;
// the save fails on every rank at the commit, and `latest` still names the previous checkpoint.
TEST(MpiZero, AShardWhoseMastersCannotBeReadFailsTheCheckpointWithoutAHang) {
  namespace fs = std::filesystem;
  auto pg = group();
  const fs::path dir = "/tmp/kuai_mpi_master_eio";
  if (pg->rank() == 0) fs::remove_all(dir);
  pg->barrier();
  const train::TrainConfig cfg = train::load_config(
      "",
      small_run(with_zero1_masters({"--run.dir=" + dir.string(), "--run.name=r", "--train.steps=6",
                                    "--checkpoint.save_every=2", "--checkpoint.async=false",
                                    "--checkpoint.on_error=stop", "--log.save_weights=false"})));
  train::StepParts* parts = nullptr;
  train::TrainOptions o;
  o.group = pg;
  o.built = [&](train::StepParts& p) { parts = &p; };
  o.after_step = [&](int64_t step) {
    // Steps 3 and 4 read each of the three files chunk by chunk; then the save's pass.
    if (step == 2 && pg->rank() == 1) {
      io::ChunkStream& st = parts->zero->offloaded()->stream();
      st.inject_failure(false, 2 * st.chunks() * st.files() + 1, EIO);
    }
  };
  std::ostringstream out;
  const train::TrainResult r = train::run_training(cfg, out, o);
  expect_save_at_4_failed_everywhere(r, *pg, dir / "r", "rank 1", "Input/output error");
}

// The same for the final weights-only export, which rank 0 writes from every rank's masters: a
// rank whose masters cannot be read makes every rank's run fail (rank 0 saying another rank
// failed, that rank naming its file) instead of an export holding zeros, or a hang.
TEST(MpiZero, AnExportWhoseMastersCannotBeReadFailsOnEveryRank) {
  namespace fs = std::filesystem;
  auto pg = group();
  const fs::path dir = "/tmp/kuai_mpi_master_export_eio";
  if (pg->rank() == 0) fs::remove_all(dir);
  pg->barrier();
  const train::TrainConfig cfg =
      train::load_config("", small_run(with_zero1_masters({"--run.dir=" + dir.string(),
                                                           "--run.name=r", "--train.steps=2"})));
  train::StepParts* parts = nullptr;
  train::TrainOptions o;
  o.group = pg;
  o.built = [&](train::StepParts& p) { parts = &p; };
  o.after_step = [&](int64_t step) {
    if (step == 2 && pg->rank() == 1)  // the export's pass is the next one
      parts->zero->offloaded()->stream().inject_failure(false, 1, EIO);
  };
  std::ostringstream out;
  std::string error;
  try {
    (void)train::run_training(cfg, out, o);
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find(pg->rank() == 0 ? "failed on 1 other rank" : "Input/output error"),
            std::string::npos)
      << error;
  EXPECT_FALSE(fs::exists(dir / "r/model.safetensors"));
  pg->barrier();
}

// Re-sharding: the optimizer state of a 2-rank ZeRO-1 checkpoint (one shard per rank, split along
// DDP's buckets) restores into unsharded AdamW, into ZeRO on one rank, and an unsharded
// checkpoint into ZeRO on 2 ranks over another partition; every moment equals the unsharded run's
// bit for bit (ZeRO-1 trains like it bit for bit). A 2-rank ZeRO checkpoint also resumes training
// in one process without ZeRO, and a missing shard is an error naming its file.
TEST(MpiZero, CheckpointsReshardAcrossWorldSizesAndStages) {
  namespace fs = std::filesystem;
  auto pg = group();
  const fs::path dir = "/tmp/kuai_mpi_reshard";
  if (pg->rank() == 0) fs::remove_all(dir);
  pg->barrier();
  auto args = [&](const std::string& name, const std::string& zero) {
    return small_run({"--run.dir=" + dir.string(), "--run.name=" + name, "--train.steps=4",
                      "--dist.zero=" + zero, "--dist.bucket_mb=0.01", "--checkpoint.save_every=4"});
  };
  std::ostringstream out;
  train::TrainOptions o;
  o.group = pg;
  train::run_training(train::load_config("", args("plain", "0")), out, o);
  train::run_training(train::load_config("", args("zero", "1")), out, o);
  pg->barrier();
  const train::Checkpoint plain = train::read_checkpoint((dir / "plain/ckpt-4").string());
  const train::Checkpoint sharded = train::read_checkpoint((dir / "zero/ckpt-4").string());
  ASSERT_EQ(plain.world_size, 1);
  ASSERT_EQ(sharded.world_size, 2);
  const train::TrainConfig cfg = train::load_config(plain.path + "/config.toml", {});
  optim::AdamWOptions ao;

  // The reference: the unsharded checkpoint in unsharded AdamW.
  nn::GPT ref_model(cfg.model, 1);
  optim::AdamW ref(train::param_groups(ref_model, 0.1f), ao);
  train::restore_checkpoint(plain, ref_model, ref);
  std::map<const void*, std::pair<size_t, size_t>> at;  // reference parameter -> (group, index)
  for (size_t g = 0; g < ref.groups().size(); ++g)
    for (size_t i = 0; i < ref.groups()[g].params.size(); ++i)
      at[ref.groups()[g].params[i].impl()] = {g, i};
  std::map<std::string, std::pair<size_t, size_t>> ref_at;
  for (const auto& [name, p] : ref_model.named_parameters()) ref_at[name] = at[p.impl()];
  // Every piece of `shard` holds the reference's elements.
  auto expect_reference = [&](const train::OptimizerShard& shard, const std::string& what) {
    int64_t elements = 0;
    for (const train::OptimizerPiece& piece : shard.pieces) {
      const auto [g, i] = ref_at.at(piece.param);
      for (const auto& [got, want] : {std::pair{piece.exp_avg, ref.exp_avg()[g][i]},
                                      std::pair{piece.exp_avg_sq, ref.exp_avg_sq()[g][i]}}) {
        const std::vector<float> all = want.to_vector<float>(), mine = got.to_vector<float>();
        const std::vector<float> expect(all.begin() + piece.begin,
                                        all.begin() + piece.begin + got.numel());
        EXPECT_EQ(mine, expect) << what << ": " << piece.param << " @" << piece.begin;
      }
      elements += piece.exp_avg.numel();
    }
    EXPECT_GT(elements, 0) << what;
    EXPECT_EQ(shard.optimizer->step_count(), ref.step_count()) << what;
  };

  {  // 2 ranks' shards -> unsharded AdamW
    nn::GPT m(cfg.model, 2);
    optim::AdamW opt(train::param_groups(m, 0.1f), ao);
    train::restore_checkpoint(sharded, m, opt);
    expect_reference(train::optimizer_shard(m, opt), "2-rank ZeRO into AdamW");
    const auto pm = m.parameters(), pr = ref_model.parameters();
    for (size_t i = 0; i < pm.size(); ++i)
      EXPECT_EQ(pm[i].to_vector<float>(), pr[i].to_vector<float>()) << "param " << i;
  }
  {  // 2 ranks' shards -> ZeRO on one rank (one shard of everything)
    nn::GPT m(cfg.model, 3);
    ZeroAdamW opt(train::param_groups(m, 0.1f), ao, single_process_group());
    const train::OptimizerShard shard = train::optimizer_shard(m, opt);
    train::restore_checkpoint(sharded, m, shard);
    expect_reference(shard, "2-rank ZeRO into 1-rank ZeRO");
  }
  {  // unsharded -> ZeRO on 2 ranks, one bucket in group order (not DDP's buckets)
    nn::GPT m(cfg.model, 4);
    ZeroAdamW opt(train::param_groups(m, 0.1f), ao, pg);
    const train::OptimizerShard shard = train::optimizer_shard(m, opt);
    train::restore_checkpoint(plain, m, shard);
    expect_reference(shard, "AdamW into 2-rank ZeRO");
  }
  pg->barrier();
  if (pg->rank() == 0) {
    // Training goes on in one process, without ZeRO, from the 2-rank ZeRO checkpoint.
    train::TrainOptions alone;
    alone.group = single_process_group();
    alone.resume = sharded.path;
    alone.write_run_dir = false;
    const train::TrainResult r = train::run_training(
        train::load_config(sharded.path + "/config.toml", {"--dist.zero=0", "--train.steps=6"}),
        out, alone);
    EXPECT_EQ(r.start_step, 4);
    EXPECT_EQ(r.losses.size(), 2u);
    // A shard gone: named.
    const fs::path broken = dir / "broken";
    fs::copy(sharded.path, broken, fs::copy_options::recursive);
    fs::remove(broken / "optimizer.rank1.safetensors");
    try {
      train::read_checkpoint(broken.string());
      ADD_FAILURE() << "a checkpoint without its rank-1 shard was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("optimizer.rank1.safetensors: missing"),
                std::string::npos)
          << e.what();
    }
  }
  pg->barrier();
}

// ZeRO-1: AdamW with its moments sharded over the 2 ranks gives the unsharded AdamW's parameters
// bit for bit (the update is elementwise), holding at most 0.55x of the optimizer state; the
// trainer's losses with dist.zero = 1 are those without, bit for bit.
TEST(MpiZero, ShardedAdamWEqualsUnshardedWithHalfTheState) {
  auto pg = group();
  nn::GPT a(small(), 11), b(small(), 11);
  optim::AdamWOptions ao;
  ao.lr = 1e-2f;
  optim::AdamW plain(train::param_groups(a, 0.1f), ao);
  // Gathered 1000 elements per rank at a time: many chunks, the last one partial.
  DistributedDataParallel da(a, pg), db(b, pg);
  ZeroAdamW sharded(train::param_groups(b, 0.1f), ao, pg, {}, 1, /*gather_chunk=*/1000);
  for (int64_t step = 0; step < 3; ++step) {
    const Batch g = global_batch(10 + step, 8);
    const Tensor x = rows_of(g.x, pg->rank() * 4, 4), y = rows_of(g.y, pg->rank() * 4, 4);
    for (auto [m, d] : {std::pair{&a, &da}, std::pair{&b, &db}}) {
      d->zero_grad();
      d->prepare_backward(true);
      m->loss(x, y).backward();
      d->finish_backward();
    }
    plain.step(0.9f);
    sharded.step(0.9f);
  }
  const auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(pa[i].to_vector<float>(), pb[i].to_vector<float>()) << "param " << i;
  const double unsharded = static_cast<double>(sharded.num_elements()) * 8;
  EXPECT_LE(sharded.state_bytes(), 0.55 * unsharded);
}

// ZeRO-2: each bucket reduce-scattered straight into the optimizer's gradient shard (small
// buckets, so there are many, each split between the ranks): the parameters are unsharded
// AdamW's bit for bit (for 2 ranks a reduce-scatter adds the same two numbers as the all-reduce),
// with 2 micro-batches (no_sync on the first); between steps no full gradient is held, and the
// gradient shard and the moments are each at most 0.55x of their unsharded size.
TEST(MpiZero, Stage2EqualsUnshardedAndHoldsNoFullGradients) {
  auto pg = group();
  nn::GPT a(small(), 12), b(small(), 12);
  optim::AdamWOptions ao;
  ao.lr = 1e-2f;
  DDPOptions small_buckets;
  small_buckets.bucket_mb = 0.004;
  small_buckets.first_bucket_mb = 0.001;
  DistributedDataParallel da(a, pg, small_buckets), db(b, pg, small_buckets);
  ASSERT_GE(db.buckets().size(), 6u);
  optim::AdamW plain(train::param_groups(a, 0.1f), ao);
  ZeroAdamW sharded(train::param_groups(b, 0.1f), ao, pg, db.bucket_params(), 2, 700);
  db.shard_gradients(sharded.gradient_shards());
  for (int64_t step = 0; step < 3; ++step) {
    const Batch g = global_batch(20 + step, 16);
    for (auto [m, d] : {std::pair{&a, &da}, std::pair{&b, &db}}) {
      d->zero_grad();
      for (int micro = 0; micro < 2; ++micro) {
        d->prepare_backward(micro == 1);
        const int64_t row = pg->rank() * 8 + micro * 4;
        m->loss(rows_of(g.x, row, 4), rows_of(g.y, row, 4)).backward();
      }
      d->finish_backward();
    }
    plain.step(0.9f);
    sharded.step(0.9f);
    for (const Tensor& p : b.parameters()) EXPECT_FALSE(p.grad().defined());
    for (const auto& bucket : db.buckets()) EXPECT_FALSE(bucket.flat.defined());
  }
  const auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(pa[i].to_vector<float>(), pb[i].to_vector<float>()) << "param " << i;
  const double n = static_cast<double>(sharded.num_elements());
  EXPECT_LE(static_cast<double>(sharded.state_bytes()), 0.55 * n * 8);
  EXPECT_LE(static_cast<double>(sharded.gradient_shard().nbytes()), 0.55 * n * 4);
}

// The trainer with dist.zero = 1 gives the losses of unsharded training bit for bit; with
// dist.zero = 2 within 1e-6 relative (the clipping norm is summed over shards in another order:
// the same in double, rounded to float once), also with 2 micro-batches and in fp16 (the
// overflow check combined across ranks).
std::vector<float> trainer_losses(const std::string& zero, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = small_run({"--train.steps=5", "--dist.zero=" + zero,
                                             "--dist.bucket_mb=0.01", "--log.save_weights=false"});
  args.insert(args.end(), extra.begin(), extra.end());
  std::ostringstream out;
  train::TrainOptions o;
  o.write_run_dir = false;
  o.group = group();
  return train::run_training(train::load_config("", args), out, o).losses;
}

TEST(MpiZero, TrainerLossesAreTheSameWithZero1And2) {
  const std::vector<float> base = trainer_losses("0");
  EXPECT_EQ(trainer_losses("1"), base);
  expect_close(trainer_losses("2"), base, 1e-6, "zero 2");
  expect_close(trainer_losses("2", {"--train.accum_steps=2"}),
               trainer_losses("0", {"--train.accum_steps=2"}), 1e-6, "zero 2, accumulation");
  expect_close(trainer_losses("2", {"--train.precision=fp16"}),
               trainer_losses("0", {"--train.precision=fp16"}), 1e-6, "zero 2, fp16");
  const std::vector<float> llama = trainer_losses("0", kLlama);
  EXPECT_EQ(trainer_losses("1", kLlama), llama) << "llama, zero 1";
  expect_close(trainer_losses("2", kLlama), llama, 1e-6, "llama, zero 2");
}

// --timeout-demo: rank 1 skips the collective; rank 0's 2 s deadline passes.
int timeout_demo() {
  auto pg = mpi_process_group({2.0});
  Tensor t = zeros({4});
  if (pg->rank() == 0)
    pg->all_reduce(t, ReduceOp::kSum)->wait();
  else
    std::this_thread::sleep_for(std::chrono::seconds(30));
  finalize();
  return 0;  // not reached on rank 0
}

// --kill-demo / --exit-demo: DDP training; rank 1 dies at step 3 (SIGKILL), or exits there
// without a collective and without finalising (_exit, as a crash in a library would). Rank 0,
// waiting for it in the step's first all-reduce, names it when mpirun ends the run.
int kill_demo(bool exit_instead) {
  auto pg = mpi_process_group({30.0});
  nn::GPT model(small(), 8);
  DistributedDataParallel ddp(model, pg);
  for (int64_t step = 0; step < 1000; ++step) {
    if (pg->rank() == 1 && step == 3) {
      if (exit_instead) std::_Exit(3);
      std::raise(SIGKILL);
    }
    const Batch g = global_batch(step, 8);
    ddp.zero_grad();
    ddp.prepare_backward(true);
    model.loss(rows_of(g.x, pg->rank() * 4, 4), rows_of(g.y, pg->rank() * 4, 4)).backward();
    ddp.finish_backward();
  }
  finalize();
  return 0;
}

// kuai plan on 2 ranks (kuai/plan/): the predicted peak of live tensors of a rank is what the
// trainer measures on it within 5% (the bar is 10%) with DDP's buckets, ZeRO-1's moment shards,
// ZeRO-2's gradient shard and its buckets freed after their reduce-scatter, and bf16 compression's
// wire buffers, in fp32 and bf16, both families.
TEST(MpiPlan, PeakOfARankIsPredictedWithin5Percent) {
  auto pg = group();
  kuai::plan::set_quick_measurements(true);
  kuai::plan::Link link;
  link.bandwidth_gbs = 1;
  link.latency_us = 10;
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {},
           {"--dist.zero=1"},
           {"--dist.zero=2"},
           {"--dist.zero=2", "--train.precision=bf16", "--model.family=llama",
            "--model.n_kv_head=2"},
           {"--dist.compression=bf16", "--train.accum_steps=2"}}) {
    std::vector<std::string> args = {
        "--model.n_layer=2",          "--model.d_model=64",      "--model.n_head=4",
        "--model.seq_len=64",         "--train.batch_size=4",    "--train.steps=3",
        "--train.eval_every=0",       "--data.source=synthetic", "--log.progress=off",
        "--log.jsonl=false",          "--log.tensorboard=false", "--log.save_weights=false",
        "--dist.first_bucket_mb=0.1", "--dist.bucket_mb=0.2"};
    args.insert(args.end(), extra.begin(), extra.end());
    const train::TrainConfig cfg = train::load_config("", args);
    kuai::plan::MachineCosts costs;
    const kuai::plan::Prediction p = kuai::plan::predict(cfg, 2, int64_t{1} << 40, link, costs);
    Allocator::get().empty_cache();
    train::TrainOptions o;
    o.write_run_dir = false;
    o.quiet = true;
    o.group = pg;
    std::ostringstream out;
    const train::TrainResult r = train::run_training(cfg, out, o);
    EXPECT_NEAR(double(p.step.peak_bytes) / double(r.peak_alloc_bytes), 1.0, 0.05)
        << "predicted " << p.step.peak_bytes << " measured " << r.peak_alloc_bytes << " at "
        << p.step.peak_where << " with " << fmt::format("{}", fmt::join(extra, " "));
  }
  kuai::plan::set_quick_measurements(false);
}

}  // namespace
}  // namespace kuai::dist

namespace kuai::dist {
int kill_gather_demo();  // tests/mpi/test_zero3.cpp
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--kill-gather-demo") == 0) return kuai::dist::kill_gather_demo();
    if (std::strcmp(argv[i], "--timeout-demo") == 0) return kuai::dist::timeout_demo();
    if (std::strcmp(argv[i], "--kill-demo") == 0) return kuai::dist::kill_demo(false);
    if (std::strcmp(argv[i], "--exit-demo") == 0) return kuai::dist::kill_demo(true);
  }
  auto pg = kuai::dist::mpi_process_group({60.0});
  if (pg->rank() != 0) GTEST_FLAG_SET(brief, true);  // before Init: the printer reads it there
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  kuai::dist::finalize();
  return rc;
}
