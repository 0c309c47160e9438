// Tests of softmax forward/backward against the double-precision reference: odd shapes, causal
// and not, several scales, and inputs large enough (|x| up to 120) that exp without the max
// subtraction would overflow float.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu {
namespace {

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 1},   {3, 17},   {5, 33}, {64, 256},
                                                          {51, 17}, {7, 1000}, {2, 1},  {300, 64}};

using kuai::test::uniform;

struct Case {
  float range;  // inputs uniform on [-range, range]
  float scale;
};
// Large ranges use power-of-two scales (scale * x exact); the non-power-of-two scale uses small
// inputs, so the float rounding of scale * x (inherent to any fp32 softmax) stays below 1e-6.
const std::vector<Case> kCases = {{3.0f, 1.0f}, {120.0f, 1.0f}, {120.0f, 0.125f}, {4.0f, 0.37f}};

// Float error sources: the argument a = scale x - max is rounded (relative 2^-24, i.e. an
// absolute |a| 2^-24 on the exponent), exp is 1 ulp, the 16-lane float sum, 1/sum and the
// product add ~4 ulp. An output y >= 1e-9 has |a| <= 21, so its relative error is below
// (21 + 8) 2^-24 < 2e-6; smaller outputs are checked to an absolute 1e-15.
TEST(Softmax, ForwardMatchesReference) {
  for (auto [rows, cols] : kShapes) {
    for (const Case& c : kCases) {
      for (bool causal : {false, true}) {
        const auto x = uniform(rows * cols, -c.range, c.range, 31);
        std::vector<float> y(rows * cols, -1.0f), want(rows * cols);
        softmax_forward(x.data(), y.data(), rows, cols, c.scale, causal);
        ref::softmax_forward(x.data(), want.data(), rows, cols, c.scale, causal);
        int failures = 0;
        for (int64_t i = 0; i < rows * cols && failures < 5; ++i) {
          const bool masked = causal && i % cols > (i / cols) % cols;
          const bool ok =
              masked ? y[i] == 0.0f : std::fabs(y[i] - want[i]) <= 2e-6 * want[i] + 1e-15;
          if (!ok) {
            ++failures;
            ADD_FAILURE() << rows << "x" << cols << " range " << c.range << " scale " << c.scale
                          << " causal " << causal << " i=" << i << " got " << y[i] << " want "
                          << want[i];
          }
        }
      }
    }
  }
}

// dx = scale y (dy - dot). The float dot (16 lanes, <= 1000 terms) is off by at most ~64 ulp of
// sum |y dy| <= max |dy| = 1, and dx rounds thrice: |dx - ref| <= scale y (|dy| + 1) 2^-24 * 80.
TEST(Softmax, BackwardMatchesReference) {
  for (auto [rows, cols] : kShapes) {
    for (const Case& c : kCases) {
      for (bool causal : {false, true}) {
        const auto x = uniform(rows * cols, -c.range, c.range, 32);
        const auto dy = uniform(rows * cols, -1.0f, 1.0f, 33);
        std::vector<float> y(rows * cols), dx(rows * cols), want(rows * cols);
        softmax_forward(x.data(), y.data(), rows, cols, c.scale, causal);
        softmax_backward(y.data(), dy.data(), dx.data(), rows, cols, c.scale);
        ref::softmax_backward(y.data(), dy.data(), want.data(), rows, cols, c.scale);
        int failures = 0;
        for (int64_t i = 0; i < rows * cols && failures < 5; ++i) {
          const double tol = 80 * 0x1p-24 * c.scale * y[i] * (std::fabs(dy[i]) + 1.0);
          if (!(std::fabs(dx[i] - want[i]) <= tol)) {
            ++failures;
            ADD_FAILURE() << rows << "x" << cols << " scale " << c.scale << " causal " << causal
                          << " i=" << i << " got " << dx[i] << " want " << want[i];
          }
        }
      }
    }
  }
}

// In place (y == x) is allowed and gives the same result.
TEST(Softmax, ForwardInPlace) {
  const int64_t rows = 9, cols = 37;
  auto x = uniform(rows * cols, -5.0f, 5.0f, 34);
  std::vector<float> want(rows * cols);
  softmax_forward(x.data(), want.data(), rows, cols, 0.5f, true);
  softmax_forward(x.data(), x.data(), rows, cols, 0.5f, true);
  EXPECT_EQ(x, want);
}

}  // namespace
}  // namespace kuai::cpu
