// Single-process tests of the process group and the DDP reducer (world size 1; the multi-rank
// tests are tests/mpi, run under mpirun): the single group's collectives; DDP's buckets (reverse
// registration order, a small first bucket, gradients as views into bucket memory); training
// through DDP is bit-identical to plain training; no_sync accumulates; an unused parameter is an
// error naming it, or is averaged as zero with find_unused; ZeRO-2's gradient sharding on one rank
// (buckets allocated by backward and released after their reduce-scatter) trains like plain
// AdamW bit for bit.
#include <gtest/gtest.h>

#include <cstring>

#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/process_group.h"
#include "kuai/distributed/zero.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"

namespace kuai::dist {
namespace {

nn::GPTConfig small() {
  nn::GPTConfig c;
  c.vocab_size = 61;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 32;
  c.seq_len = 16;
  return c;
}

TEST(ProcessGroup, SingleProcessCollectivesAreTheIdentity) {
  auto pg = single_process_group();
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->rank(), 0);
  Tensor t = from_vector(std::vector<float>{1, 2, 3}, {3});
  pg->all_reduce(t, ReduceOp::kAvg)->wait();
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1, 2, 3}));
  Tensor out = zeros({3});
  pg->reduce_scatter(t, out, ReduceOp::kSum)->wait();
  EXPECT_EQ(out.to_vector<float>(), t.to_vector<float>());
  Tensor g = zeros({3});
  pg->all_gather(t, g)->wait();
  EXPECT_EQ(g.to_vector<float>(), t.to_vector<float>());
  pg->broadcast(t, 0)->wait();
  pg->barrier();
  EXPECT_THROW(pg->all_reduce(zeros({2}, DType::kI32), ReduceOp::kSum), std::invalid_argument);
  EXPECT_FALSE(launched_by_mpi());
  EXPECT_EQ(default_process_group()->backend(), "single");
}

TEST(DDP, BucketsRunInReverseOrderWithGradientsAsViewsOfThem) {
  nn::GPT model(small(), 1);
  DDPOptions o;
  o.first_bucket_mb = 0.01;  // ~2.6K floats
  o.bucket_mb = 0.05;
  DistributedDataParallel ddp(model, single_process_group(), o);
  const auto& b = ddp.buckets();
  ASSERT_GE(b.size(), 3u);
  const auto named = model.named_parameters();
  EXPECT_EQ(b[0].names[0], named.back().first);  // the last registered fills the first bucket
  EXPECT_LE(b[0].flat.nbytes(), static_cast<int64_t>(0.01 * (1 << 20)) + 4 * 32 * 32);
  int64_t total = 0;
  for (const auto& bucket : b) total += bucket.flat.numel();
  EXPECT_EQ(total, model.num_parameters());
  EXPECT_EQ(ddp.bytes_per_sync(), total * 4);
  // Every gradient lies inside its bucket's memory.
  for (const auto& [name, p] : named) {
    const char* g = static_cast<const char*>(p.grad().raw_data());
    bool inside = false;
    for (const auto& bucket : b) {
      const char* f = static_cast<const char*>(bucket.flat.raw_data());
      inside |= g >= f && g + p.nbytes() <= f + bucket.flat.nbytes();
    }
    EXPECT_TRUE(inside) << name;
  }
}

std::vector<std::vector<float>> grads_of(const nn::GPT& model) {
  std::vector<std::vector<float>> out;
  for (const Tensor& p : model.parameters()) out.push_back(p.grad().to_vector<float>());
  return out;
}

TEST(DDP, OneRankEqualsPlainTrainingBitForBitAndNoSyncAccumulates) {
  Generator g(7, 0);
  const Tensor x1 = g.randint({2, 16}, 0, 61), y1 = g.randint({2, 16}, 0, 61);
  const Tensor x2 = g.randint({2, 16}, 0, 61), y2 = g.randint({2, 16}, 0, 61);
  nn::GPT plain(small(), 3), wrapped(small(), 3);
  plain.loss(x1, y1).backward();
  plain.loss(x2, y2).backward();  // accumulates
  DistributedDataParallel ddp(wrapped, single_process_group());
  ddp.zero_grad();
  ddp.prepare_backward(false);  // no_sync: local accumulation only
  wrapped.loss(x1, y1).backward();
  ddp.prepare_backward(true);
  wrapped.loss(x2, y2).backward();
  ddp.finish_backward();
  EXPECT_EQ(grads_of(wrapped), grads_of(plain));
  ddp.zero_grad();
  for (const Tensor& p : wrapped.parameters())
    for (float v : p.grad().to_vector<float>()) ASSERT_EQ(v, 0.0f);
}

TEST(DDP, ShardedGradientsOnOneRankTrainLikePlainAdamW) {
  nn::GPT plain(small(), 5), sharded(small(), 5);
  optim::AdamWOptions ao;
  ao.lr = 1e-2f;
  optim::AdamW adamw({{plain.parameters(), 0.1f}}, ao);
  DDPOptions small_buckets;
  small_buckets.bucket_mb = 0.004;
  small_buckets.first_bucket_mb = 0.001;
  DistributedDataParallel ddp(sharded, single_process_group(), small_buckets);
  ASSERT_GE(ddp.buckets().size(), 6u);
  ZeroAdamW zero({{sharded.parameters(), 0.1f}}, ao, single_process_group(), ddp.bucket_params(),
                 2);
  ddp.shard_gradients(zero.gradient_shards());
  EXPECT_FALSE(ddp.buckets()[0].flat.defined());
  Generator g(9, 0);
  for (int step = 0; step < 3; ++step) {
    const Tensor x1 = g.randint({2, 16}, 0, 61), y1 = g.randint({2, 16}, 0, 61);
    const Tensor x2 = g.randint({2, 16}, 0, 61), y2 = g.randint({2, 16}, 0, 61);
    adamw.zero_grad();
    plain.loss(x1, y1).backward();
    plain.loss(x2, y2).backward();
    adamw.step(0.5f);
    ddp.prepare_backward(false);
    sharded.loss(x1, y1).backward();
    ddp.prepare_backward(true);
    sharded.loss(x2, y2).backward();
    ddp.finish_backward();
    for (const Tensor& p : sharded.parameters()) EXPECT_FALSE(p.grad().defined());
    zero.step(0.5f);
  }
  const auto a = plain.parameters(), b = sharded.parameters();
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(a[i].to_vector<float>(), b[i].to_vector<float>()) << "param " << i;
  EXPECT_EQ(zero.shard_size(), zero.num_elements());  // one rank holds everything
}

// DDP over the whole GPT plus one parameter the loss never touches: the error names that one
// parameter and no other; with find_unused it is averaged as zero and every GPT gradient is the
// plain model's bit for bit.
TEST(DDP, AnUnusedParameterIsNamedOrAveragedAsZero) {
  nn::GPT model(small(), 4), plain(small(), 4);
  Tensor extra = zeros({5});
  extra.requires_grad_();
  struct WithExtra : nn::Module {
    WithExtra(Tensor e) { register_parameter("unused.weight", e); }
  };
  struct Both : nn::Module {  // the GPT (not owned) and the extra parameter
    Both(nn::GPT& g, Tensor e) {
      register_module("gpt", std::shared_ptr<nn::GPT>(&g, [](nn::GPT*) {}));
      register_module("extra", std::make_shared<WithExtra>(e));
    }
  };
  Generator g(8, 0);
  const Tensor x = g.randint({2, 16}, 0, 61), y = g.randint({2, 16}, 0, 61);
  plain.loss(x, y).backward();
  {
    Both m(model, extra);
    DistributedDataParallel ddp(m, single_process_group());
    ASSERT_EQ(ddp.bytes_per_sync(), (model.num_parameters() + 5) * 4);  // the GPT is wrapped
    ddp.prepare_backward(true);
    model.loss(x, y).backward();
    try {
      ddp.finish_backward();
      FAIL() << "expected an error";
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("parameter extra.unused.weight received no gradient"), std::string::npos)
          << what;
      EXPECT_EQ(what.find("gpt."), std::string::npos) << "only the unused one is named: " << what;
    }
  }
  Both m(model, extra);
  DDPOptions o;
  o.find_unused = true;
  DistributedDataParallel ddp(m, single_process_group(), o);
  ddp.zero_grad();
  ddp.prepare_backward(true);
  model.loss(x, y).backward();
  ddp.finish_backward();
  EXPECT_EQ(extra.grad().to_vector<float>(), std::vector<float>(5, 0.0f));
  EXPECT_EQ(grads_of(model), grads_of(plain));
}

}  // namespace
}  // namespace kuai::dist
