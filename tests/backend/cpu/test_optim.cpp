// Tests of the AdamW and SGD steps against the double-precision references: several steps with
// bias correction, weight decay, gradient scaling, momentum, dampening and Nesterov, at sizes
// that exercise the vector tails and the multi-chunk parallel path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu {
namespace {

const std::vector<int64_t> kSizes = {1, 7, 15, 17, 1000003};
constexpr int kSteps = 5;

using kuai::test::uniform;

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel,
                  double abs, const char* what, int step) {
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    if (!(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + abs)) {
      ++failures;
      ADD_FAILURE() << what << " n=" << got.size() << " step " << step << " i=" << i << " got "
                    << got[i] << " want " << want[i];
    }
  }
}

struct AdamCase {
  float lr, weight_decay, grad_scale;
};

// Fast and reference run side by side from the same start, each keeping its own float state.
// m = b1 m + (1 - b1) g can cancel to near 0, so its per-step rounding is bounded by the terms:
// 2^-24 (|b1 m| + |(1 - b1) g| + |m_new|) <= 2^-24 * 2 G with G = max |g| grad_scale = 2
// grad_scale: abs 2.5e-7 grad_scale per step. v sums positive terms: relative 1e-6. p: the update
// lr * mhat / (sqrt(vhat) + eps) is computed to ~8 ulp (sqrt, divide, folded bias corrections), so
// p drifts from the reference by ~1e-6 lr per step on top of its own rounding (2^-24 |p| per
// step): rel 1e-6 plus abs 1e-6 lr * steps.
TEST(Optim, AdamWMatchesReference) {
  const std::vector<AdamCase> cases = {
      {1e-3f, 0.0f, 1.0f}, {3e-4f, 0.1f, 1.0f}, {1e-2f, 0.01f, 0.25f}};
  for (int64_t n : kSizes) {
    for (const AdamCase& c : cases) {
      auto p = uniform(n, -1.0f, 1.0f, 41);
      std::vector<float> m(n, 0.0f), v(n, 0.0f);
      auto p_ref = p, m_ref = m, v_ref = v;
      for (int t = 1; t <= kSteps; ++t) {
        auto g = uniform(n, -2.0f, 2.0f, 100 + t);
        if (n > 3) g[3] = 0.0f;  // zero gradient: only decay moves p
        AdamWParams hp{c.lr, 0.9f, 0.999f, 1e-8f, c.weight_decay, 0.0f, 0.0f, c.grad_scale};
        hp.bias_correction1 = 1.0f - std::pow(hp.beta1, static_cast<float>(t));
        hp.bias_correction2 = 1.0f - std::pow(hp.beta2, static_cast<float>(t));
        adamw_step(p.data(), g.data(), m.data(), v.data(), n, hp);
        ref::adamw_step(p_ref.data(), g.data(), m_ref.data(), v_ref.data(), n, hp);
        expect_close(m, m_ref, 1e-6, 2.5e-7 * c.grad_scale * t, "adamw m", t);
        expect_close(v, v_ref, 1e-6, 1e-30, "adamw v", t);
        expect_close(p, p_ref, 1e-6, 1e-6 * c.lr * t, "adamw p", t);
      }
    }
  }
}

struct SgdCase {
  float lr, momentum, dampening, weight_decay, grad_scale;
  bool nesterov;
};

// With g in [-1, 1], |d| = |g grad_scale + wd p| <= D ~ grad_scale and, after 5 steps of
// momentum 0.9, |buf| <= 4.1 D. A step rounds buf = mu buf + (1 - damp) d by at most
// 2^-24 (|mu buf| + |d| + |buf_new|) <= 2^-24 * 9 D: abs 6e-7 D per step (cancellation makes a
// relative bound useless). p rounds its own value (2^-24 |p|, |p| <= 1.x) and inherits lr times
// the buf error: abs 1e-7 (1 + D) per step.
TEST(Optim, SgdMatchesReference) {
  const std::vector<SgdCase> cases = {{0.1f, 0.0f, 0.0f, 0.0f, 1.0f, false},
                                      {0.05f, 0.0f, 0.0f, 0.01f, 0.5f, false},
                                      {0.1f, 0.9f, 0.0f, 0.0f, 1.0f, false},
                                      {0.1f, 0.9f, 0.1f, 1e-4f, 0.5f, false},
                                      {0.1f, 0.9f, 0.0f, 1e-4f, 2.0f, true}};
  for (int64_t n : kSizes) {
    for (const SgdCase& c : cases) {
      auto p = uniform(n, -1.0f, 1.0f, 51);
      std::vector<float> buf(n, 0.0f);
      auto p_ref = p, buf_ref = buf;
      float* buf_ptr = c.momentum == 0.0f ? nullptr : buf.data();  // unused without momentum
      for (int t = 1; t <= kSteps; ++t) {
        const auto g = uniform(n, -1.0f, 1.0f, 200 + t);
        sgd_step(p.data(), g.data(), buf_ptr, n, c.lr, c.momentum, c.dampening, c.weight_decay,
                 c.nesterov, t == 1, c.grad_scale);
        ref::sgd_step(p_ref.data(), g.data(), buf_ref.data(), n, c.lr, c.momentum, c.dampening,
                      c.weight_decay, c.nesterov, t == 1, c.grad_scale);
        const double d_max = c.grad_scale + c.weight_decay * 2.0;
        expect_close(p, p_ref, 1e-6, 1e-7 * (1.0 + d_max) * t, "sgd p", t);
        if (c.momentum != 0.0f) expect_close(buf, buf_ref, 1e-6, 6e-7 * d_max * t, "sgd buf", t);
      }
    }
  }
}

}  // namespace
}  // namespace kuai::cpu
