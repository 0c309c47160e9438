// Tests of softmax forward/backward against the double-precision reference: odd shapes, causal
// and not, several scales, and inputs large enough (|x| up to 120) that exp without the max
// subtraction would overflow float.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"
#include "kuai/backend/cpu/vec_math.h"

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

// The lane-parallel row maximum (softmax's and flash attention's) against the one-element-at-a-
// time chain m = max(m, scale * x[j]): equal (the maximum is exact), at every length around its
// 8- and 32-element steps, with the maximum in the vector body and in the tail, NaN skipped,
// -inf rows and scales below and above 1; for both vector widths (8 floats in the AVX copies, 4
// in the baseline one), which also return the same zero (+0 or -0) for a zero maximum.
template <int W>
void check_max_of() {
  SCOPED_TRACE(testing::Message() << "W=" << W);
  auto chain = [](const float* x, int64_t n, float scale) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, scale * x[j]);
    return m;
  };
  for (int64_t n = 0; n <= 100; ++n) {
    for (float scale : {1.0f, 0.125f, 0.37f, 3.0f}) {
      auto x = uniform(n, -50.0f, 50.0f, static_cast<uint32_t>(7 + n));
      EXPECT_EQ(vm::max_of<W>(x.data(), n, scale), chain(x.data(), n, scale)) << n;
      for (int64_t at : {int64_t{0}, n / 2, n - 1}) {  // the maximum at the head, middle, tail
        if (n == 0) continue;
        auto y = x;
        y[at] = 60.0f;
        EXPECT_EQ(vm::max_of<W>(y.data(), n, scale), 60.0f * scale) << n << " " << at;
        y[(at + 1) % n] = NAN;  // skipped, wherever it lands
        if ((at + 1) % n != at) {
          EXPECT_EQ(vm::max_of<W>(y.data(), n, scale), 60.0f * scale) << n << " " << at;
        }
        // A zero maximum of mixed signs: the same zero at either width.
        auto z = x;
        for (auto& v : z) v = -std::fabs(v) - 1.0f;
        z[at] = -0.0f;
        z[(at + 7) % n] = 0.0f;
        z[(at + 19) % n] = -0.0f;
        EXPECT_EQ(std::bit_cast<uint32_t>(vm::max_of<W>(z.data(), n, scale)),
                  std::bit_cast<uint32_t>(vm::max_of<8>(z.data(), n, scale)))
            << n << " " << at;
      }
    }
    std::vector<float> ninf(n, -INFINITY);
    EXPECT_EQ(vm::max_of<W>(ninf.data(), n), -INFINITY) << n;
  }
}

TEST(VecMath, MaxOfEqualsTheChain) {
  check_max_of<8>();
  check_max_of<4>();
}

// vm::exp as the library's kernels run it: a loop in a KUAI_CLONE kernel, one copy per ISA.
KUAI_KERNEL void exp_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = vm::exp(x[i]);
}
KUAI_CLONE(exp_rows, exp_kernel)

using ExpCopy = void (*)(const float*, float*, int64_t);

// The copies this CPU runs at the tier in force and below it.
std::vector<std::pair<const char*, ExpCopy>> exp_copies() {
  std::vector<std::pair<const char*, ExpCopy>> copies{
      {"baseline", [](const float* x, float* y, int64_t n) { exp_rows_baseline(x, y, n); }}};
#if KUAI_HAVE_ISA_CLONES
  if (clone_variant() >= Isa::kAvx2)
    copies.push_back({"avx2", [](const float* x, float* y, int64_t n) { exp_rows_avx2(x, y, n); }});
  if (clone_variant() >= Isa::kAvx512)
    copies.push_back(
        {"avx512", [](const float* x, float* y, int64_t n) { exp_rows_avx512(x, y, n); }});
#endif
  return copies;
}

// Every 4099th float of both signs, 4096 floats on each side of every edge of exp's range (its
// clamps at 89 and -104, where a float result overflows, turns subnormal and rounds to 0, 0 and
// 1), the input of the largest error measured over every float (1.010 ulp at AVX2 and AVX-512),
// infinities and NaNs.
std::vector<float> exp_inputs() {
  std::vector<float> x;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4099)
    x.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  for (float edge : {89.0f, -104.0f, 88.7228394f, -87.3365479f, -103.972076f, 0.0f, -0.0f, 1.0f,
                     -0x1.782f42p+2f}) {
    const auto e = std::bit_cast<uint32_t>(edge);
    for (uint32_t d = 0; d < 4096; ++d) {
      x.push_back(std::bit_cast<float>(e + d));
      if (d <= e) x.push_back(std::bit_cast<float>(e - d));
    }
  }
  for (float v : {INFINITY, -INFINITY, NAN, -NAN, FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN})
    x.push_back(v);
  x.push_back(std::bit_cast<float>(uint32_t{0x7f800001}));  // a signalling NaN
  return x;
}

// Against exp in double: results within 1.02 ulp where they are normal floats (1.010 is the
// largest error over every float), within one step of 2^-149 where they are subnormal (0.75
// measured), +inf or FLT_MAX where the exact value passes FLT_MAX, 0 for x at or below -104; NaN
// for NaN, 0 for -inf, +inf for +inf.
TEST(VecMath, ExpIsWithinAnUlpOverTheFloatsOnEveryIsaCopy) {
  const std::vector<float> x = exp_inputs();
  std::vector<float> y(x.size());
  for (auto [name, copy] : exp_copies()) {
    SCOPED_TRACE(name);
    std::fill(y.begin(), y.end(), -1.0f);
    copy(x.data(), y.data(), static_cast<int64_t>(x.size()));
    int failures = 0;
    for (size_t i = 0; i < x.size() && failures < 5; ++i) {
      bool ok;
      const double want = std::exp(static_cast<double>(x[i]));
      if (std::isnan(x[i])) {
        ok = std::isnan(y[i]);
      } else if (want > FLT_MAX) {
        ok = y[i] == INFINITY || y[i] == FLT_MAX;
      } else if (want < FLT_MIN) {
        ok = std::fabs(y[i] - want) <= std::ldexp(1.0, -149) && (x[i] > -104.0f || y[i] == 0.0f);
      } else {
        const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
        ok = std::fabs(y[i] - want) <= 1.02 * ulp;
      }
      if (!ok) {
        ++failures;
        ADD_FAILURE() << "exp(" << std::hexfloat << x[i] << ") = " << y[i] << ", want " << want;
      }
    }
  }
}

}  // namespace
}  // namespace kuai::cpu
