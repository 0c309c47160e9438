// Capture (kuai/compile/capture.h): one training step of the tiny GPT recorded at the dispatch
// point holds its forward, its backward (with gradient accumulation), clipping, the loss scaler
// and one AdamW update per parameter, in order, with the parameters and moments as external
// values the updates write; under bf16 autocast it holds the casts. The captured step is an
// ordinary step: its loss and parameters equal an uncaptured step's bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

#include "kuai/compile/capture.h"
#include "tests/compile/training_step.h"

namespace kuai::compiler {
namespace {

using test::batch_of;
using test::tiny;
using test::Trainer;

class CaptureStep : public ::testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(CaptureStep, RecordsTheWholeStepAndRunsItAsUsual) {
  const auto [dtype, micro] = GetParam();
  // The moments exist before the step (Trainer calls ensure_state): state made inside a captured
  // step would be made anew by every replay.
  Trainer plain(dtype), captured(dtype);
  const std::vector<Tensor> batch = batch_of(0, micro);
  const std::vector<Tensor> want = plain.step(batch);
  std::vector<Tensor> got;
  const auto named = captured.model.named_parameters();
  const Graph graph = capture([&] { got = captured.step(batch); });

  // The captured step is an ordinary step.
  ASSERT_EQ(got.size(), want.size());
  for (size_t m = 0; m < got.size(); ++m) EXPECT_EQ(got[m].item(), want[m].item());
  const auto a = plain.state(), b = captured.state();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "state tensor " << i;

  const int64_t n = static_cast<int64_t>(named.size());
  // One AdamW update per parameter, one clip factor, one scaler update (fp16), one norm.
  EXPECT_EQ(graph.count("adamw_update"), n);
  EXPECT_EQ(graph.count("grad_norm"), 1);
  EXPECT_EQ(graph.count("clip_coefficient"), 1);
  EXPECT_EQ(graph.count("unscale_and_check"), dtype == DType::kF16 ? n : 0);
  EXPECT_EQ(graph.count("scaler_update"), dtype == DType::kF16 ? 1 : 0);
  // No per-step number is baked into the graph: the step count advances on the device (skipped
  // there on an fp16 overflow) and AdamW's lr and bias corrections are computed in the graph from
  // it and the optimizer's lr tensor, the only per-step inputs the host writes.
  EXPECT_EQ(graph.count("advance_step_"), 1);
  EXPECT_EQ(graph.count("adamw_hyper"), 1);
  for (const Node& node : graph.nodes) {
    if (node.primitive->name() == "adamw_hyper") {
      EXPECT_EQ(graph.values[node.inputs[0]].external.impl(), captured.opt.step_tensor().impl());
      EXPECT_EQ(graph.values[node.inputs[1]].external.impl(), captured.opt.lr_tensor().impl());
    }
    if (node.primitive->name() == "adamw_update") {
      EXPECT_GE(graph.values[node.inputs[4]].producer, 0) << "hyper made in the graph";
    }
  }
  // Every parameter is an external value that an update writes; so are both moments of each.
  std::set<const TensorImpl*> params;
  for (const auto& [name, p] : named) params.insert(p.impl());
  int64_t written_params = 0, written = 0;
  for (const Value& v : graph.values) {
    if (v.producer >= 0 || !v.written) continue;
    ++written;
    written_params += params.count(v.external.impl());
  }
  EXPECT_EQ(written_params, n);
  EXPECT_GE(written, 3 * n);
  // The forward and the backward: one linear per projection, products in backward, and with
  // 2 micro-batches the second accumulates every gradient in place (add_ also runs with one,
  // inside backward: the tied embedding and the residual stream sum their gradients).
  int64_t in_backward = 0;
  for (const Node& node : graph.nodes) in_backward += node.backward;
  EXPECT_GT(in_backward, 0);
  EXPECT_EQ(graph.count("linear"), micro * (tiny().n_layer * 4 + 1));
  EXPECT_GE(graph.count("add_"), micro > 1 ? n : 1);
  // Autocast's casts are in the graph: the weights once per micro-batch guard (the cache lives
  // for one guard), the activations as they enter the products.
  if (dtype != DType::kF32) {
    EXPECT_GT(graph.count("cast"), micro * (tiny().n_layer * 4 + 1));
  }
  // The dump has one line per node, the updates marked in place.
  const std::string dump = graph.dump();
  EXPECT_EQ(static_cast<size_t>(std::count(dump.begin(), dump.end(), '\n')), graph.nodes.size());
  EXPECT_NE(dump.find("adamw_update ("), std::string::npos);
  EXPECT_NE(dump.find(") in place"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(PrecisionsAndMicroBatches, CaptureStep,
                         ::testing::Values(std::tuple{DType::kF32, 1}, std::tuple{DType::kF32, 2},
                                           std::tuple{DType::kBF16, 1},
                                           std::tuple{DType::kF16, 2}));

// Named outputs refer to values the captured code made; a tensor from outside is an error.
TEST(Capture, MarkedOutputsAreValuesOfTheGraph) {
  const Tensor a = full({3}, 1.0f), b = full({3}, 2.0f);
  Tensor c;
  const Graph g =
      capture([&] { c = add(a, b); },
              [&](CaptureMode& mode) {
                mode.mark_output("c", c);
                EXPECT_THROW(mode.mark_output("b", from_vector(std::vector<float>{0, 0, 0}, {3})),
                             std::invalid_argument);
              });
  ASSERT_EQ(g.nodes.size(), 1u);
  EXPECT_EQ(g.num_externals(), 2);
  const int id = g.output("c");
  ASSERT_GE(id, 0);
  EXPECT_EQ(g.values[static_cast<size_t>(id)].producer, 0);
  EXPECT_EQ(g.output("missing"), -1);
}

}  // namespace
}  // namespace kuai::compiler
