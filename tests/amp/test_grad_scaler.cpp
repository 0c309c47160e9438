// Tests of the dynamic loss scaler on a tiny model (two fp32 parameters, gradients set by hand,
// AdamW): an inf or NaN gradient skips the step without touching parameters, moments or the step
// count, and halves the scale; clean steps grow it every growth_interval; unscaling is exact for
// power-of-two scales, so a scaled step equals an unscaled one bit for bit, with or without
// gradient accumulation; state round-trips; a disabled scaler changes nothing.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "../support/random.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/core/ops.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"

namespace kuai::amp {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

using kuai::test::uniform;

// Two parameters, w (4) and b (2, 3), with fixed values.
struct TinyModel {
  std::vector<Tensor> params;
  TinyModel() {
    params.push_back(from_vector({0.5f, -0.25f, 1.0f, 0.125f}, {4}));
    params.push_back(from_vector({0.1f, 0.2f, -0.3f, 0.4f, -0.5f, 0.6f}, {2, 3}));
    for (Tensor& p : params) p.requires_grad_();
  }
  optim::AdamW adamw() const {
    return optim::AdamW({optim::ParamGroup{params, 0.01f}}, optim::AdamWOptions{1e-2f});
  }
};

// Gradients for step t, multiples of 2^-10 in [-2, 2): exact in fp32 at any power-of-two scale.
std::vector<std::vector<float>> grads_for(int t) {
  std::vector<std::vector<float>> g = {uniform(4, -2.0f, 2.0f, 300 + t),
                                       uniform(6, -2.0f, 2.0f, 400 + t)};
  for (auto& v : g)
    for (float& x : v) x = std::round(x * 1024.0f) / 1024.0f;
  return g;
}

// Sets every parameter's .grad to factor * values (factor a power of two: exact).
void set_grads(const std::vector<Tensor>& params, const std::vector<std::vector<float>>& values,
               float factor = 1.0f) {
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<float> v = values[i];
    for (float& x : v) x *= factor;
    Tensor(params[i]).set_grad(from_vector(v, params[i].shape()));
  }
}

// Everything a step could change, flattened: parameters, then exp_avg, then exp_avg_sq.
std::vector<float> snapshot(const TinyModel& m, const optim::AdamW& opt) {
  std::vector<float> out;
  auto append = [&](const Tensor& t) {
    const auto v = t.to_vector<float>();
    out.insert(out.end(), v.begin(), v.end());
  };
  for (const Tensor& p : m.params) append(p);
  for (const auto& group : opt.exp_avg())
    for (const Tensor& t : group) append(t);
  for (const auto& group : opt.exp_avg_sq())
    for (const Tensor& t : group) append(t);
  return out;
}

void expect_bitwise_equal(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

// One training step as the trainer runs it: grads = S * g (the backward of S * loss), unscale_,
// clip factor from the unscaled gradients, step, update. Returns whether it stepped.
bool scaled_step(GradScaler& scaler, optim::AdamW& opt, const std::vector<Tensor>& params,
                 const std::vector<std::vector<float>>& g, float max_norm = 0.0f) {
  set_grads(params, g, scaler.scale());
  const Tensor found_inf = scaler.unscale_(params);
  const Tensor clip = optim::clip_coefficient(optim::grad_norm_tensor(params), max_norm);
  const bool stepped = scaler.step(opt, found_inf, clip);
  scaler.update(found_inf);
  opt.zero_grad();
  return stepped;
}

// A good step first (moments non-zero), then one whose gradient holds `bad`.
void check_skipped_step(float bad) {
  TinyModel m;
  optim::AdamW opt = m.adamw();
  GradScaler scaler;
  ASSERT_TRUE(scaled_step(scaler, opt, m.params, grads_for(1)));
  const auto before = snapshot(m, opt);
  const int64_t steps_before = opt.step_count();
  ASSERT_EQ(steps_before, 1);

  auto g = grads_for(2);
  g[1][4] = bad;
  set_grads(m.params, g, scaler.scale());
  const Tensor found_inf = scaler.unscale_(m.params);
  EXPECT_EQ(found_inf.item(), 1.0f);
  EXPECT_FALSE(scaler.step(opt, found_inf, Tensor()));
  scaler.update(found_inf);

  EXPECT_EQ(scaler.scale(), 32768.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_EQ(opt.step_count(), steps_before);
  expect_bitwise_equal(snapshot(m, opt), before);
}

TEST(GradScaler, InfGradientSkipsStepAndBacksOff) {
  check_skipped_step(kInf);
  check_skipped_step(-kInf);
}

TEST(GradScaler, NanGradientSkipsStepAndBacksOff) { check_skipped_step(kNaN); }

// growth_interval = 3: three clean steps double the scale; an inf in between restarts the count.
TEST(GradScaler, GrowsAfterIntervalAndInfResetsTracker) {
  TinyModel m;
  optim::AdamW opt = m.adamw();
  GradScalerOptions o;
  o.init_scale = 1024.0f;
  o.growth_interval = 3;
  GradScaler scaler(o);
  EXPECT_TRUE(scaled_step(scaler, opt, m.params, grads_for(1)));
  EXPECT_TRUE(scaled_step(scaler, opt, m.params, grads_for(2)));
  EXPECT_EQ(scaler.growth_tracker(), 2);
  EXPECT_EQ(scaler.scale(), 1024.0f);

  auto bad = grads_for(3);
  bad[0][0] = kInf;
  EXPECT_FALSE(scaled_step(scaler, opt, m.params, bad));
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_EQ(scaler.scale(), 512.0f);

  for (int t = 4; t <= 5; ++t) {
    EXPECT_TRUE(scaled_step(scaler, opt, m.params, grads_for(t)));
    EXPECT_EQ(scaler.scale(), 512.0f);
  }
  EXPECT_TRUE(scaled_step(scaler, opt, m.params, grads_for(6)));
  EXPECT_EQ(scaler.scale(), 1024.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  EXPECT_EQ(opt.step_count(), 5);  // six calls, one skipped
}

// unscale_ multiplies by exactly 1/scale and skips parameters without a gradient.
TEST(GradScaler, UnscaleMultipliesByExactInverse) {
  TinyModel m;
  Tensor no_grad = from_vector({3.0f}, {1});
  no_grad.requires_grad_();
  std::vector<Tensor> params = m.params;
  params.push_back(no_grad);
  GradScaler scaler;
  const auto g = grads_for(1);
  set_grads(m.params, g, 65536.0f);
  const Tensor found_inf = scaler.unscale_(params);
  EXPECT_EQ(found_inf.dtype(), DType::kF32);
  EXPECT_EQ(found_inf.numel(), 1);
  EXPECT_EQ(found_inf.device(), kCPU);
  EXPECT_EQ(found_inf.item(), 0.0f);
  for (size_t i = 0; i < m.params.size(); ++i)
    expect_bitwise_equal(m.params[i].grad().to_vector<float>(), g[i]);
  EXPECT_FALSE(no_grad.grad().defined());
}

// A non-contiguous gradient (a transposed view) is replaced by its unscaled contiguous copy.
TEST(GradScaler, UnscalesNonContiguousGradient) {
  Tensor w = zeros({3, 2});
  w.requires_grad_();
  const Tensor g = from_vector({1024.0f, -2048.0f, 512.0f, 4096.0f, -256.0f, 128.0f}, {2, 3});
  w.set_grad(transpose(g, 0, 1));
  ASSERT_FALSE(w.grad().is_contiguous());
  GradScalerOptions o;
  o.init_scale = 256.0f;
  GradScaler scaler(o);
  EXPECT_EQ(scaler.unscale_({w}).item(), 0.0f);
  EXPECT_TRUE(w.grad().is_contiguous());
  EXPECT_EQ(w.grad().shape(), Shape({3, 2}));
  EXPECT_EQ(w.grad().to_vector<float>(),
            std::vector<float>({4.0f, 16.0f, -8.0f, -1.0f, 2.0f, 0.5f}));
  EXPECT_EQ(g.to_vector<float>()[0], 1024.0f);  // the viewed tensor is left alone
}

// The gradient of scale(loss, S) through autograd is S times the plain one; unscale_ recovers it.
TEST(GradScaler, ScaledBackwardThenUnscaleRecoversGradient) {
  Tensor w = from_vector({0.5f, -1.5f, 2.0f}, {3});
  w.requires_grad_();
  const Tensor x = from_vector({0.25f, 3.0f, -0.75f}, {3});
  GradScaler scaler;
  scale(sum(mul(w, x)), scaler.scale()).backward();
  EXPECT_EQ(w.grad().to_vector<float>(), std::vector<float>({16384.0f, 196608.0f, -49152.0f}));
  EXPECT_EQ(scaler.unscale_({w}).item(), 0.0f);
  expect_bitwise_equal(w.grad().to_vector<float>(), x.to_vector<float>());
}

// Scale the loss (hence the gradients) by S, unscale, step with clipping: the same parameters and
// moments as plain AdamW on the unscaled gradients, bit for bit, over several steps.
TEST(GradScaler, ScaledStepEqualsUnscaledStep) {
  TinyModel scaled_model, plain_model;
  optim::AdamW scaled_opt = scaled_model.adamw(), plain_opt = plain_model.adamw();
  GradScaler scaler;
  const float max_norm = 1.0f;  // the gradients' norm is above it: clipping is active
  for (int t = 1; t <= 4; ++t) {
    const auto g = grads_for(t);
    ASSERT_TRUE(scaled_step(scaler, scaled_opt, scaled_model.params, g, max_norm));
    set_grads(plain_model.params, g);
    plain_opt.step(optim::clip_coefficient(optim::grad_norm_tensor(plain_model.params), max_norm));
    plain_opt.zero_grad();
  }
  EXPECT_EQ(scaled_opt.step_count(), plain_opt.step_count());
  expect_bitwise_equal(snapshot(scaled_model, scaled_opt), snapshot(plain_model, plain_opt));
}

// Two micro-batches (loss / 2 each, scaled by S) accumulated into .grad, one unscale_: the same
// step as one batch whose gradient is (g1 + g2) / 2.
TEST(GradScaler, AccumulatedMicroBatchesEqualOneBigBatch) {
  TinyModel accum_model, big_model;
  optim::AdamW accum_opt = accum_model.adamw(), big_opt = big_model.adamw();
  GradScaler scaler;
  for (int t = 1; t <= 3; ++t) {
    const auto g1 = grads_for(10 * t), g2 = grads_for(10 * t + 1);
    const float s = scaler.scale();
    set_grads(accum_model.params, g1, s * 0.5f);
    for (size_t i = 0; i < accum_model.params.size(); ++i) {
      std::vector<float> v = g2[i];
      for (float& x : v) x *= s * 0.5f;
      add_(accum_model.params[i].grad(), from_vector(v, accum_model.params[i].shape()));
    }
    const Tensor found_inf = scaler.unscale_(accum_model.params);
    ASSERT_TRUE(scaler.step(accum_opt, found_inf, Tensor()));
    scaler.update(found_inf);
    accum_opt.zero_grad();

    auto big = g1;
    for (size_t i = 0; i < big.size(); ++i)
      for (size_t j = 0; j < big[i].size(); ++j) big[i][j] = (g1[i][j] + g2[i][j]) * 0.5f;
    set_grads(big_model.params, big);
    big_opt.step(1.0f);
    big_opt.zero_grad();
  }
  expect_bitwise_equal(snapshot(accum_model, accum_opt), snapshot(big_model, big_opt));
}

// state() / load_state(): a restored scaler continues exactly as the original.
TEST(GradScaler, StateRoundTrip) {
  GradScalerOptions o;
  o.growth_interval = 3;
  GradScaler a(o);
  a.update(true);
  a.update(false);
  a.update(false);
  const GradScalerState s = a.state();
  EXPECT_EQ(s.scale, 32768.0f);
  EXPECT_EQ(s.growth_tracker, 2);

  GradScaler b(o);
  b.load_state(s);
  EXPECT_EQ(b.scale(), 32768.0f);
  EXPECT_EQ(b.growth_tracker(), 2);
  a.update(false);
  b.update(false);
  EXPECT_EQ(a.scale(), 65536.0f);
  EXPECT_EQ(b.scale(), a.scale());
  EXPECT_EQ(b.growth_tracker(), a.growth_tracker());

  EXPECT_THROW(b.load_state({0.0f, 0}), std::invalid_argument);
  EXPECT_THROW(b.load_state({kInf, 0}), std::invalid_argument);
  EXPECT_THROW(b.load_state({kNaN, 0}), std::invalid_argument);
  EXPECT_THROW(b.load_state({1.0f, -1}), std::invalid_argument);
}

// Disabled: scale 1, gradients untouched (even non-finite ones), a zero flag, the step always
// runs, update changes nothing.
TEST(GradScaler, DisabledIsNoOp) {
  TinyModel m;
  optim::AdamW opt = m.adamw();
  GradScalerOptions o;
  o.enabled = false;
  GradScaler scaler(o);
  EXPECT_FALSE(scaler.enabled());
  EXPECT_EQ(scaler.scale(), 1.0f);
  auto g = grads_for(1);
  g[0][1] = kInf;
  set_grads(m.params, g);
  const Tensor found_inf = scaler.unscale_(m.params);
  EXPECT_EQ(found_inf.item(), 0.0f);
  for (size_t i = 0; i < m.params.size(); ++i)
    expect_bitwise_equal(m.params[i].grad().to_vector<float>(), g[i]);
  EXPECT_NO_THROW(scaler.unscale_(m.params));  // no once-per-step guard when disabled

  set_grads(m.params, grads_for(2));
  EXPECT_TRUE(scaler.step(opt, full({}, 1.0f), Tensor()));  // even a raised flag is ignored
  EXPECT_EQ(opt.step_count(), 1);
  scaler.update(true);
  scaler.update(full({}, 1.0f));
  EXPECT_EQ(scaler.scale(), 1.0f);
  EXPECT_EQ(scaler.growth_tracker(), 0);
}

// The scale stays finite and a normal float: growth past FLT_MAX is refused (tracker resets),
// backoff stops at FLT_MIN.
TEST(GradScaler, ScaleStaysFiniteAndPositive) {
  GradScalerOptions o;
  o.growth_interval = 2;
  GradScaler scaler(o);
  const float top = std::ldexp(1.0f, 127);
  scaler.load_state({top, 1});
  scaler.update(false);
  EXPECT_EQ(scaler.scale(), top);
  EXPECT_EQ(scaler.growth_tracker(), 0);

  scaler.load_state({std::ldexp(1.0f, -125), 0});
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), FLT_MIN);
  scaler.update(true);
  EXPECT_EQ(scaler.scale(), FLT_MIN);
  EXPECT_TRUE(std::isfinite(1.0f / scaler.scale()));
}

TEST(GradScaler, RejectsBadOptionsAndDoubleUnscale) {
  auto with = [](auto edit) {
    GradScalerOptions o;
    edit(o);
    return o;
  };
  EXPECT_THROW((void)GradScaler(with([](GradScalerOptions& o) { o.init_scale = 0.0f; })),
               std::invalid_argument);
  EXPECT_THROW((void)GradScaler(with([](GradScalerOptions& o) { o.growth_factor = 1.0f; })),
               std::invalid_argument);
  EXPECT_THROW((void)GradScaler(with([](GradScalerOptions& o) { o.backoff_factor = 1.0f; })),
               std::invalid_argument);
  EXPECT_THROW((void)GradScaler(with([](GradScalerOptions& o) { o.growth_interval = 0; })),
               std::invalid_argument);

  TinyModel m;
  GradScaler scaler;
  set_grads(m.params, grads_for(1), scaler.scale());
  const Tensor found_inf = scaler.unscale_(m.params);
  EXPECT_THROW(scaler.unscale_(m.params), std::logic_error);
  scaler.update(found_inf);
  set_grads(m.params, grads_for(2), scaler.scale());
  EXPECT_NO_THROW(scaler.unscale_(m.params));  // once per step again after update()

  optim::AdamW opt = m.adamw();
  EXPECT_THROW(scaler.step(opt, from_vector({0.0f, 0.0f}, {2}), Tensor()), std::invalid_argument);
  EXPECT_THROW(scaler.step(opt, Tensor(), Tensor()), std::invalid_argument);
}

}  // namespace
}  // namespace kuai::amp
