// Tests of the elementwise CPU kernels against plain loops (exact ops must match bit for bit)
// and of GELU forward/backward against the double-precision reference in reference.h, at sizes
// that are not multiples of any vector width and one large enough to use several threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {
namespace {

const std::vector<int64_t> kSizes = {1, 7, 15, 17, 1000003};
constexpr float kInf = std::numeric_limits<float>::infinity();

using kuai::test::uniform;

// |got - want| <= rel * |want| + abs, NaN matches NaN, infinities must match exactly. Reports
// the first few failures only.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel,
                  double abs, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    const double g = got[i], w = want[i];
    bool ok;
    if (std::isnan(w) || std::isnan(g)) {
      ok = std::isnan(w) && std::isnan(g);
    } else if (std::isinf(w) || std::isinf(g)) {
      ok = g == w;
    } else {
      ok = std::fabs(g - w) <= rel * std::fabs(w) + abs;
    }
    if (!ok) {
      ++failures;
      ADD_FAILURE() << what << " n=" << got.size() << " i=" << i << " got " << g << " want " << w;
    }
  }
}

TEST(Elementwise, ReportsIsa) {
  const std::string isa = isa_name();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "baseline") << isa;
}

// add/sub/mul/div/scale/fill are one IEEE operation per element: bit-exact against a plain loop.
TEST(Elementwise, BinaryOpsExact) {
  for (int64_t n : kSizes) {
    const auto a = uniform(n, -3.0f, 3.0f, 1);
    auto b = uniform(n, -3.0f, 3.0f, 2);
    for (auto& x : b) x = x == 0.0f ? 1.0f : x;
    std::vector<float> y(n), want(n);
    add(a.data(), b.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] + b[i];
    EXPECT_EQ(y, want) << "add n=" << n;
    sub(a.data(), b.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] - b[i];
    EXPECT_EQ(y, want) << "sub n=" << n;
    mul(a.data(), b.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] * b[i];
    EXPECT_EQ(y, want) << "mul n=" << n;
    div(a.data(), b.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] / b[i];
    EXPECT_EQ(y, want) << "div n=" << n;
    scale(a.data(), -0.37f, y.data(), n);
    for (int64_t i = 0; i < n; ++i) want[i] = -0.37f * a[i];
    EXPECT_EQ(y, want) << "scale n=" << n;
    fill(y.data(), 2.5f, n);
    EXPECT_EQ(y, std::vector<float>(n, 2.5f)) << "fill n=" << n;
  }
}

TEST(Elementwise, InPlaceAliasing) {
  for (int64_t n : kSizes) {
    auto a = uniform(n, -3.0f, 3.0f, 3);
    const auto b = uniform(n, -3.0f, 3.0f, 4);
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] * b[i];
    mul(a.data(), b.data(), a.data(), n);  // y == a
    EXPECT_EQ(a, want) << "n=" << n;
  }
}

// axpy may be fused (FMA) in the AVX2/AVX-512 clones and unfused in the baseline: the result is
// within one rounding of y and one of alpha*x, i.e. 2^-24 * (|y_old| + |alpha x| + |y_new|).
TEST(Elementwise, Axpy) {
  for (int64_t n : kSizes) {
    const auto x = uniform(n, -3.0f, 3.0f, 5);
    const auto y0 = uniform(n, -3.0f, 3.0f, 6);
    auto y = y0;
    const float alpha = 0.731f;
    axpy(alpha, x.data(), y.data(), n);
    int failures = 0;
    for (int64_t i = 0; i < n && failures < 5; ++i) {
      const double ax = static_cast<double>(alpha) * x[i];
      const double want = y0[i] + ax;
      const double tol = 0x1p-24 * (std::fabs(y0[i]) + std::fabs(ax) + std::fabs(want));
      if (std::fabs(y[i] - want) > tol) {
        ++failures;
        ADD_FAILURE() << "axpy n=" << n << " i=" << i << " got " << y[i] << " want " << want;
      }
    }
  }
}

// Row broadcasts are one IEEE operation per element: bit-exact.
TEST(Elementwise, RowBroadcastExact) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1}, {3, 17}, {5, 33}, {64, 256}, {1000, 769}};
  for (auto [rows, cols] : shapes) {
    const auto x = uniform(rows * cols, -3.0f, 3.0f, 7);
    const auto b = uniform(cols, -3.0f, 3.0f, 8);
    std::vector<float> y(rows * cols), want(rows * cols);
    add_row(x.data(), b.data(), y.data(), rows, cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) want[r * cols + c] = x[r * cols + c] + b[c];
    EXPECT_EQ(y, want) << "add_row " << rows << "x" << cols;
    mul_row(x.data(), b.data(), y.data(), rows, cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) want[r * cols + c] = x[r * cols + c] * b[c];
    EXPECT_EQ(y, want) << "mul_row " << rows << "x" << cols;
  }
}

// Inputs for GELU: uniform on [-10, 10] plus the special values at the front.
std::vector<float> gelu_inputs(int64_t n, uint32_t seed) {
  auto x = uniform(n, -10.0f, 10.0f, seed);
  const float special[] = {kInf, -kInf, 0.0f, -0.0f, -0.75f, 20.0f, -20.0f, 1e30f, -1e30f};
  for (int64_t i = 0; i < n && i < 9; ++i) x[i] = special[i];
  return x;
}

// Forward: exp is within 1 ulp, the sigmoid form x / (1 + exp(-2u)) adds ~3 roundings, and the
// rounding of u (relative 2^-23) moves sigmoid by |u| 2^-23 (1 - s), which only matters where the
// output is tiny. 1e-6 relative (~8 ulp) plus 1e-7 absolute covers both.
TEST(Elementwise, GeluForwardMatchesReference) {
  for (int64_t n : kSizes) {
    const auto x = gelu_inputs(n, 11);
    std::vector<float> y(n), want(n);
    gelu_forward(x.data(), y.data(), n);
    ref::gelu_forward(x.data(), want.data(), n);
    expect_close(y, want, 1e-6, 1e-7, "gelu_forward");
  }
}

// Backward: gelu' = s + 2 x u' s (1 - s); near its zero (x ~ -0.75) the two terms (~0.23 each)
// cancel, leaving a few ulp of the terms as absolute error: 1e-6 relative plus 2e-7 absolute
// (dy is in [-1, 1]).
TEST(Elementwise, GeluBackwardMatchesReference) {
  for (int64_t n : kSizes) {
    const auto x = gelu_inputs(n, 12);
    const auto dy = uniform(n, -1.0f, 1.0f, 13);
    std::vector<float> dx(n), want(n);
    gelu_backward(x.data(), dy.data(), dx.data(), n);
    ref::gelu_backward(x.data(), dy.data(), want.data(), n);
    expect_close(dx, want, 1e-6, 2e-7, "gelu_backward");
  }
}

// bf16 / f16 storage: the fp32 kernels with the conversion in registers. Bit for bit what
// widening, the fp32 kernel and one round-to-nearest-even give (same arithmetic, same rounding);
// NaN stays NaN. add_f32_lowp is exact against the fp32 add of the widened operand.
std::vector<uint16_t> narrow(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> h(x.size());
  convert(x.data(), DType::kF32, h.data(), t, static_cast<int64_t>(x.size()));
  return h;
}
std::vector<float> widen(const std::vector<uint16_t>& h, DType t) {
  std::vector<float> x(h.size());
  convert(h.data(), t, x.data(), DType::kF32, static_cast<int64_t>(h.size()));
  return x;
}

TEST(Elementwise, LowPrecisionStorageKernelsEqualWidenComputeRound) {
  for (DType t : {DType::kBF16, DType::kF16})
    for (int64_t n : kSizes) {
      auto xf = gelu_inputs(n, 14);
      if (n > 9) xf[9] = std::numeric_limits<float>::quiet_NaN();
      const auto x = narrow(xf, t), dy = narrow(uniform(n, -1.0f, 1.0f, 15), t);
      const auto x32 = widen(x, t), dy32 = widen(dy, t);
      std::vector<uint16_t> y(n), dx(n);
      std::vector<float> y32(n), dx32(n);
      gelu_forward_lowp(x.data(), y.data(), n, t);
      gelu_forward(x32.data(), y32.data(), n);
      gelu_backward_lowp(x.data(), dy.data(), dx.data(), n, t);
      gelu_backward(x32.data(), dy32.data(), dx32.data(), n);
      const auto want_y = narrow(y32, t), want_dx = narrow(dx32, t);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(y[i], want_y[i]) << dtype_name(t) << " gelu_forward_lowp at " << i;
        ASSERT_EQ(dx[i], want_dx[i]) << dtype_name(t) << " gelu_backward_lowp at " << i;
      }
      const auto a = uniform(n, -3.0f, 3.0f, 16);
      std::vector<float> sum(n);
      add_f32_lowp(a.data(), dy.data(), sum.data(), n, t);
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(sum[i], a[i] + dy32[i]) << dtype_name(t) << " add_f32_lowp at " << i;
    }
}

// Limits and NaN: gelu(+inf) = inf, gelu(-inf) = -0, gelu'(+-inf) = 1, 0; NaN propagates.
TEST(Elementwise, GeluSpecialValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {kInf, -kInf, nan, 0.0f};
  const std::vector<float> dy(4, 1.0f);
  std::vector<float> y(4), dx(4);
  gelu_forward(x.data(), y.data(), 4);
  gelu_backward(x.data(), dy.data(), dx.data(), 4);
  EXPECT_EQ(y[0], kInf);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_TRUE(std::isnan(y[2]));
  EXPECT_EQ(y[3], 0.0f);
  EXPECT_EQ(dx[0], 1.0f);
  EXPECT_EQ(dx[1], 0.0f);
  EXPECT_TRUE(std::isnan(dx[2]));
  EXPECT_EQ(dx[3], 0.5f);
}

}  // namespace
}  // namespace kuai::cpu
