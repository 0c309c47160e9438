// Autograd engine semantics: accumulation into .grad, shared leaves, no-grad, saved tensors
// freed as soon as their node ran, grad-ready hooks firing exactly once per backward with the
// final gradient, and the order hooks fire in (reverse of use, which DDP buckets rely on).
#include <gtest/gtest.h>

#include <algorithm>

#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"

namespace kuai {
namespace {

TEST(Autograd, AccumulatesAcrossUsesAndBackwards) {
  Tensor x = from_vector({1.0f, 2.0f, 3.0f}, {3});
  x.requires_grad_();
  Tensor y = sum(add(mul(x, x), x));  // dy/dx = 2x + 1
  y.backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{3, 5, 7}));
  Tensor z = sum(scale(x, 2.0f));
  z.backward();  // accumulates
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{5, 7, 9}));
}

TEST(Autograd, SharedGradientIsNotAliasedBetweenLeaves) {
  Tensor a = from_vector({1.0f, 2.0f}, {2}), b = from_vector({3.0f, 4.0f}, {2});
  a.requires_grad_();
  b.requires_grad_();
  sum(add(a, b)).backward();  // both receive the same gradient tensor
  sum(scale(a, 10.0f)).backward();
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{11, 11}));
  EXPECT_EQ(b.grad().to_vector<float>(), (std::vector<float>{1, 1}));
}

TEST(Autograd, NoGradGuardRecordsNothing) {
  Tensor x = from_vector({1.0f}, {1});
  x.requires_grad_();
  Tensor y;
  {
    autograd::NoGradGuard guard;
    y = mul(x, x);
  }
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
  EXPECT_THROW(y.backward(), std::invalid_argument);
}

TEST(Autograd, HooksFireOnceWithFinalGradientInReverseUseOrder) {
  Tensor w1 = full({4}, 1.0f), w2 = full({4}, 2.0f);
  w1.requires_grad_();
  w2.requires_grad_();
  std::vector<std::string> order;
  int w1_calls = 0;
  std::vector<float> w1_seen;
  w1.register_hook([&](const Tensor& g) {
    ++w1_calls;
    order.push_back("w1");
    w1_seen = g.to_vector<float>();
  });
  w2.register_hook([&](const Tensor&) { order.push_back("w2"); });
  Tensor x = full({4}, 3.0f);
  // w1 used twice (first and last), w2 in the middle: w1's gradient is final only at the end.
  Tensor h = mul(x, w1);
  h = mul(h, w2);
  h = add(h, w1);
  sum(h).backward();
  EXPECT_EQ(w1_calls, 1);
  EXPECT_EQ(w1_seen, (std::vector<float>(4, 7.0f)));  // d/dw1 = x*w2 + 1 = 7
  ASSERT_EQ(order.size(), 2u);
  EXPECT_EQ(order[0], "w2");
  EXPECT_EQ(order[1], "w1");
}

TEST(Autograd, QueuedCallbacksRunOnceAfterEveryHookOfTheNextBackward) {
  Tensor w = full({4}, 1.0f);
  w.requires_grad_();
  std::vector<std::string> order;
  w.register_hook([&](const Tensor&) { order.push_back("hook"); });
  autograd::queue_callback([&] {
    order.push_back("first");
    EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>(4, 3.0f)));  // final by then
  });
  autograd::queue_callback([&] { order.push_back("second"); });
  EXPECT_EQ(autograd::queued_callbacks(), 2u);
  sum(scale(w, 3.0f)).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"hook", "first", "second"}));
  EXPECT_EQ(autograd::queued_callbacks(), 0u);
  sum(w).backward();  // run once: not again
  EXPECT_EQ(order.size(), 4u);
  EXPECT_EQ(order.back(), "hook");

  // A backward that fails drops what was queued; one that throws from a callback ends with it.
  autograd::queue_callback([&] { order.push_back("dropped"); });
  Tensor plain = full({2}, 1.0f);
  EXPECT_THROW(plain.backward(), std::invalid_argument);
  EXPECT_EQ(autograd::queued_callbacks(), 0u);
  autograd::queue_callback([] { throw std::runtime_error("bucket wait failed"); });
  EXPECT_THROW(sum(w).backward(), std::runtime_error);
  EXPECT_EQ(std::count(order.begin(), order.end(), "dropped"), 0);
}

TEST(Autograd, SavedTensorsAreFreedAsNodesRun) {
  Allocator& alloc = Allocator::get();
  Tensor w = full({1 << 16}, 0.5f);
  w.requires_grad_();
  Tensor loss;
  {
    Tensor h = w;
    for (int i = 0; i < 8; ++i) h = gelu(h);  // each gelu saves its (256 KiB) input
    loss = sum(h);
  }
  const int64_t before = alloc.stats().current;
  alloc.reset_peak();
  loss.backward();
  // During backward, saved inputs are released one by one: the peak stays well below
  // "all activations + all gradients"; after it, only w.grad (256 KiB) remains new.
  const int64_t after = alloc.stats().current;
  EXPECT_LT(after, before);                           // the 8 saved activations are gone
  EXPECT_THROW(loss.backward(), std::runtime_error);  // graph already freed
}

TEST(Autograd, NodesThatSavedNothingCanRunAgain) {
  // A cast saves nothing: a second graph that reuses a cast output (autocast's cached weight
  // casts in every micro-batch of a step) backpropagates through it again.
  Tensor w = full({4}, 0.5f);
  w.requires_grad_();
  Tensor wl = cast(w, DType::kBF16);
  sum(cast(wl, DType::kF32)).backward();
  sum(cast(scale(wl, 2.0f), DType::kF32)).backward();
  EXPECT_EQ(w.grad().to_vector<float>(), std::vector<float>(4, 3.0f));
}

TEST(Autograd, NonScalarNeedsGradOutput) {
  Tensor x = full({2}, 1.0f);
  x.requires_grad_();
  Tensor y = scale(x, 3.0f);
  EXPECT_THROW(y.backward(), std::invalid_argument);
  y.backward(full({2}, 1.0f));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{3, 3}));
}

TEST(Autograd, IntegerInputsGetNoGradient) {
  Tensor w = full({5, 2}, 1.0f);
  w.requires_grad_();
  Tensor idx = from_vector(std::vector<int32_t>{1, 1, 4}, {3});
  sum(embedding(w, idx)).backward();
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{0, 0, 2, 2, 0, 0, 0, 0, 1, 1}));
}

}  // namespace
}  // namespace kuai
