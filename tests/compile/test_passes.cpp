// The graph passes (kuai/compile/passes.h): the fused AddLayerNorm equals add then layer_norm bit
// for bit at odd sizes (one row, widths off the vector length, enough rows for several threads);
// on the captured tiny step, dead-value elimination leaves only nodes whose outputs are read or
// that write an input, the add_layer_norm pass fuses every residual add that feeds a LayerNorm
// (2 per layer), and passes can be switched off by name. That the rewritten
// step still gives eager execution's numbers is test_replay.cpp's and test_compile_training.cpp's.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "kuai/compile/capture.h"
#include "kuai/compile/executable.h"
#include "kuai/compile/memory_plan.h"
#include "kuai/compile/passes.h"
#include "kuai/core/autograd.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/primitives.h"
#include "tests/compile/training_step.h"

namespace kuai::compiler {
namespace {

// b fp32, or a bf16 / f16 branch as autocast makes it (the fp32 residual plus a low-precision
// linear's output).
TEST(Passes, AddLayerNormEqualsAddThenLayerNormBitForBit) {
  for (const DType bt : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& [N, C] : std::vector<std::pair<int64_t, int64_t>>{
             {1, 1}, {3, 17}, {5, 256}, {33, 100}, {300, 130}, {2, 4099}, {3, 9000}}) {
      Generator g(static_cast<uint64_t>(N * 1000 + C), 0);
      const Tensor a = g.normal({N, C}), b = cast(g.normal({N, C}), bt), w = g.normal({C}),
                   bias = g.normal({C});
      autograd::NoGradGuard no_grad;
      const Tensor x = add(a, b);
      ASSERT_EQ(x.dtype(), DType::kF32);
      const std::vector<Tensor> ln = dispatch(std::make_shared<LayerNorm>(1e-5f), {x, w, bias});
      const std::vector<Tensor> f =
          dispatch(std::make_shared<AddLayerNorm>(1e-5f), {a, b, w, bias});
      ASSERT_EQ(f.size(), 4u);
      const std::string at = fmt::format("{} {}x{}", dtype_name(bt), N, C);
      EXPECT_EQ(f[0].to_vector<float>(), x.to_vector<float>()) << at << " sum";
      for (size_t j = 0; j < 3; ++j)
        EXPECT_EQ(f[j + 1].to_vector<float>(), ln[j].to_vector<float>()) << at << " output " << j;
    }
}

// Odd sizes: one row, widths off the vector length, enough rows for several threads and blocks.
const std::vector<std::pair<int64_t, int64_t>> kOddSizes = {
    {1, 1}, {3, 17}, {5, 256}, {33, 100}, {300, 130}, {2, 4099}, {4100, 33}};

TEST(Passes, LayerNormBackwardAddEqualsBackwardThenAddBitForBit) {
  for (const auto& [N, C] : kOddSizes) {
    Generator g(static_cast<uint64_t>(N * 1000 + C), 1);
    const Tensor x = g.normal({N, C}), w = g.normal({C}), b = g.normal({C}), dy = g.normal({N, C});
    autograd::NoGradGuard no_grad;
    const std::vector<Tensor> ln = dispatch(std::make_shared<LayerNorm>(1e-5f), {x, w, b});
    const std::vector<Tensor> ref =
        dispatch(std::make_shared<LayerNormBackward>(), {x, w, ln[1], ln[2], dy});
    const Tensor acc_ref = g.normal({N, C});
    const Tensor acc = acc_ref.clone();
    dispatch(std::make_shared<AddInPlace>(), {acc_ref, ref[0]});
    const std::vector<Tensor> f =
        dispatch(std::make_shared<LayerNormBackwardAdd>(), {x, w, ln[1], ln[2], dy, acc});
    ASSERT_EQ(f.size(), 2u);
    EXPECT_EQ(acc.to_vector<float>(), acc_ref.to_vector<float>()) << N << "x" << C << " acc";
    EXPECT_EQ(f[0].to_vector<float>(), ref[1].to_vector<float>()) << N << "x" << C << " dw";
    EXPECT_EQ(f[1].to_vector<float>(), ref[2].to_vector<float>()) << N << "x" << C << " db";
  }
}

TEST(Passes, GeluBackwardSumEqualsGeluBackwardThenSumBitForBit) {
  for (const auto& [N, C] : kOddSizes) {
    Generator g(static_cast<uint64_t>(N * 1000 + C), 2);
    const Tensor x = g.normal({N, C}), dy = g.normal({N, C});
    autograd::NoGradGuard no_grad;
    const Tensor dx = dispatch(std::make_shared<GeluBackward>(), {x, dy})[0];
    const Tensor db = dispatch(std::make_shared<Sum>(0, false), {dx})[0];
    const std::vector<Tensor> f = dispatch(std::make_shared<GeluBackwardSum>(Shape{C}), {x, dy});
    ASSERT_EQ(f.size(), 2u);
    EXPECT_EQ(f[0].to_vector<float>(), dx.to_vector<float>()) << N << "x" << C << " dx";
    EXPECT_EQ(f[1].to_vector<float>(), db.to_vector<float>()) << N << "x" << C << " db";
  }
}

TEST(Passes, CrossEntropyWithGradEqualsForwardThenBackwardBitForBit) {
  for (const DType dt : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& [N, V] : kOddSizes) {
      Generator g(static_cast<uint64_t>(N * 1000 + V), 3);
      const Tensor logits = cast(g.normal({N, V}), dt);
      std::vector<int32_t> t(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i)
        t[static_cast<size_t>(i)] = i % 7 == 3 ? -100 : int32_t(i * 31 % V);
      const Tensor targets = from_vector(t, {N});
      const Tensor dloss = full({}, 0.37f);
      autograd::NoGradGuard no_grad;
      const std::vector<Tensor> fw =
          dispatch(std::make_shared<CrossEntropy>(-100), {logits, targets});
      // (A clone: the eager backward writes over a logits buffer that only its handle holds.)
      const Tensor dl = dispatch(std::make_shared<CrossEntropyBackward>(-100),
                                 {logits.clone(), targets, fw[1], fw[2], dloss})[0];
      const std::vector<Tensor> f =
          dispatch(std::make_shared<CrossEntropyWithGrad>(-100), {logits, targets, dloss});
      ASSERT_EQ(f.size(), 4u);
      const std::string at = fmt::format("{} {}x{}", dtype_name(dt), N, V);
      for (size_t j = 0; j < 3; ++j)
        EXPECT_EQ(f[j].to_vector<float>(), fw[j].to_vector<float>()) << at << " output " << j;
      EXPECT_EQ(cast(f[3], DType::kF32).to_vector<float>(),
                cast(dl, DType::kF32).to_vector<float>())
          << at << " dlogits";
    }
}

// The chain fuser on a graph of elementwise ops: y = gelu(a * b + c) * 0.5 - gelu'(a) * d over
// sizes around the block (4096) and the vector widths; one fused node per chain, replayed with
// the same bits as the ops one by one, with the arena poisoned (a block read before it is written
// would show). x * x and a broadcast add are left alone.
TEST(Passes, ElementwiseChainsFuseIntoOneBlockedNodeBitForBit) {
  for (const int64_t n : {1, 17, 4095, 4097, 3 * 4096 + 5, 70001}) {
    Generator g(static_cast<uint64_t>(n), 4);
    const Tensor a = g.normal({n}), b = g.normal({n}), c = g.normal({n}), d = g.normal({n});
    autograd::NoGradGuard no_grad;
    auto f = [&] {
      const Tensor h = scale(gelu(add(mul(a, b), c)), 0.5f);
      return sub(h, mul(gelu_backward(a, d), d));
    };
    const Tensor want = f();
    Tensor got;
    Graph graph = capture([&] { got = f(); }, [&](CaptureMode& m) { m.mark_output("y", got); });
    const int64_t before = static_cast<int64_t>(graph.nodes.size());
    EXPECT_EQ(fuse_elementwise_chains(graph), 2) << n;  // the two branches; sub joins one
    EXPECT_EQ(graph.count("fused_elementwise"), 2) << n;
    EXPECT_LT(static_cast<int64_t>(graph.nodes.size()), before) << n;
    ExecutableOptions options;
    options.poison = true;
    Executable exe(std::move(graph), {}, options);
    EXPECT_EQ(exe.run({})[0].to_vector<float>(), want.to_vector<float>()) << n;
  }
  // Not chains: a value read twice by its reader, a broadcast operand.
  const Tensor x = full({100}, 1.5f), row = full({4, 100}, 2.0f);
  autograd::NoGradGuard no_grad;
  Tensor y;
  Graph graph =
      capture([&] { y = add(mul(x, x), row); }, [&](CaptureMode& m) { m.mark_output("y", y); });
  EXPECT_EQ(fuse_elementwise_chains(graph), 0);
}

// The captured training step of the tiny model (`micro` micro-batches, autocast to `dtype`).
Graph tiny_step(DType dtype = DType::kF32, int micro = 1) {
  test::Trainer t(dtype);
  std::vector<Tensor> losses;
  const std::vector<Tensor> batch = test::batch_of(0, micro);
  return capture([&] { losses = t.step(batch); },
                 [&](CaptureMode& m) { m.mark_output("loss", losses[0]); });
}

// Under bf16 autocast the residual add is fp32 + bf16: fused all the same.
TEST(Passes, TheBf16ResidualAddIsFusedToo) {
  Graph g = tiny_step(DType::kBF16);
  EXPECT_EQ(run_passes(g).get("add_layer_norm"), 2 * test::tiny().n_layer);
}

TEST(Passes, DeadValueEliminationKeepsWhatIsReadOrWrites) {
  Graph g = tiny_step();
  const size_t before = g.nodes.size();
  const int64_t removed = eliminate_dead_values(g);
  EXPECT_GT(removed, 0);
  EXPECT_EQ(g.nodes.size() + static_cast<size_t>(removed), before);
  EXPECT_EQ(eliminate_dead_values(g), 0) << "a second run finds nothing";
  std::vector<bool> read(g.values.size(), false);
  for (const Node& n : g.nodes)
    for (int id : n.inputs) read[static_cast<size_t>(id)] = true;
  for (const auto& [name, id] : g.outputs) read[static_cast<size_t>(id)] = true;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    bool useful = false;
    for (int id : n.outputs) useful = useful || read[static_cast<size_t>(id)];
    for (size_t k = 0; k < n.inputs.size(); ++k) useful = useful || n.primitive->mutates_input(k);
    EXPECT_TRUE(useful) << "#" << i << " " << n.primitive->name();
    for (int id : n.outputs) EXPECT_EQ(g.values[static_cast<size_t>(id)].producer, int(i));
  }
}

TEST(Passes, EveryResidualAddThatFeedsALayerNormIsFused) {
  Graph g = tiny_step();
  const int64_t adds = g.count("add"), norms = g.count("layer_norm");
  const PassReport r = run_passes(g, PassOptions::all_but("recompute"));
  // ln_2 of each block and ln_1 of the next (ln_f after the last). ln_1 of block 0 reads the
  // embedding sum, token rows plus position rows broadcast over the batch: not a same-shape add,
  // so it stays unfused.
  const int64_t fusable = 2 * test::tiny().n_layer;
  EXPECT_EQ(r.get("add_layer_norm"), fusable);
  EXPECT_EQ(g.count("add_layer_norm"), fusable);
  EXPECT_EQ(g.count("layer_norm"), norms - fusable);
  EXPECT_EQ(g.count("add"), adds - fusable);
  EXPECT_EQ(r.nodes_after, static_cast<int64_t>(g.nodes.size()));
}

// The backward fusions on the captured tiny step: every LayerNorm backward but the first (whose dx
// starts the residual gradient) adds into it; each MLP's GELU backward takes its bias gradient;
// the loss's forward and backward become one node.
TEST(Passes, BackwardFusionsFindTheirPatternsInTheTinyStep) {
  Graph g = tiny_step();
  const int64_t lnb = g.count("layer_norm_backward"), sums = g.count("sum"),
                gelus = g.count("gelu_backward"), adds = g.count("add_");
  const PassReport r = run_passes(g);
  const int64_t L = test::tiny().n_layer;
  EXPECT_EQ(r.get("layer_norm_backward_add"), 2 * L);
  EXPECT_EQ(g.count("layer_norm_backward_add_"), 2 * L);
  EXPECT_EQ(g.count("layer_norm_backward"), lnb - 2 * L);
  EXPECT_EQ(g.count("add_"), adds - 2 * L);
  EXPECT_EQ(r.get("gelu_backward_sum"), L);
  EXPECT_EQ(g.count("gelu_backward_sum"), gelus);
  EXPECT_EQ(g.count("sum"), sums - L);
  EXPECT_EQ(r.get("cross_entropy"), 1);
  EXPECT_EQ(g.count("cross_entropy_with_grad"), 1);
  EXPECT_EQ(g.count("cross_entropy") + g.count("cross_entropy_backward"), 0);
  // Each node's outputs are made before they are read.
  std::vector<bool> made(g.values.size(), false);
  for (size_t v = 0; v < g.values.size(); ++v) made[v] = g.values[v].producer < 0;
  for (const Node& n : g.nodes) {
    for (int id : n.inputs) EXPECT_TRUE(made[static_cast<size_t>(id)]) << n.primitive->name();
    for (int id : n.outputs) made[static_cast<size_t>(id)] = true;
  }
}

// Every LayerNorm of the forward is made again just before the backward first reads its rows, from
// values the backward still holds, and the forward's copy then dies before the backward starts.
TEST(Passes, RecomputeRemakesEveryLayerNormBeforeItsBackwardRead) {
  Graph g = tiny_step();
  run_passes(g, PassOptions::all_but("recompute"));
  const int64_t forward_norms = g.count("layer_norm") + g.count("add_layer_norm");
  const int64_t bytes_before = plan_memory(g).arena_bytes;
  EXPECT_EQ(recompute_layer_norms(g), forward_norms);
  EXPECT_EQ(recompute_layer_norms(g), 0) << "a second run finds nothing";
  size_t bwd0 = 0;
  while (!g.nodes[bwd0].backward) ++bwd0;
  const std::vector<int> last = last_uses(g);
  int64_t remade = 0;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    const bool fwd_norm = i < bwd0 && (n.primitive->name() == "layer_norm" ||
                                       n.primitive->name() == "add_layer_norm");
    if (fwd_norm) {
      const int y = n.outputs[n.primitive->name() == "layer_norm" ? 0 : 1];
      EXPECT_LT(last[static_cast<size_t>(y)], static_cast<int>(bwd0)) << "#" << i;
    }
    remade += i >= bwd0 && n.primitive->name() == "layer_norm";
  }
  EXPECT_EQ(remade, forward_norms);
  EXPECT_LT(plan_memory(g).arena_bytes, bytes_before);
}

// With 2 micro-batches each forward's LayerNorms are remade in its own backward, so the second
// micro-batch's rows are not held across its backward either (where the step's peak is).
TEST(Passes, RecomputeCoversEveryMicroBatch) {
  Graph g = tiny_step(DType::kF32, 2);
  run_passes(g, PassOptions::all_but("recompute"));
  const int64_t norms = g.count("layer_norm") + g.count("add_layer_norm");
  const int64_t bytes_before = plan_memory(g).arena_bytes;
  EXPECT_EQ(recompute_layer_norms(g), norms);
  EXPECT_LT(plan_memory(g).arena_bytes, bytes_before);
}

TEST(Passes, AreSwitchedOffByName) {
  Graph g = tiny_step();
  const size_t before = g.nodes.size();
  const PassReport r =
      run_passes(g, PassOptions::all_but(fmt::format("{}", fmt::join(PassOptions::names(), ","))));
  EXPECT_EQ(g.nodes.size(), before);
  EXPECT_TRUE(r.rewrites.empty());
  EXPECT_THROW(PassOptions::all_but("fuse_everything"), std::invalid_argument);
  EXPECT_FALSE(PassOptions::all_but("add_layer_norm").add_layer_norm);
  EXPECT_TRUE(PassOptions::all_but("add_layer_norm").dead_values);
}

}  // namespace
}  // namespace kuai::compiler
