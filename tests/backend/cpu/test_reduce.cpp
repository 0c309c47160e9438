// Tests of the deterministic reductions: sum_axis against the double reference at odd shapes,
// sum_squares against a double loop, and bit-identical results for 1 and 2 OpenMP threads.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu {
namespace {

using Shape = std::tuple<int64_t, int64_t, int64_t>;  // (outer, n, inner)

const std::vector<Shape> kShapes = {{1, 1, 1},      {1, 7, 1},     {3, 17, 5},     {2, 15, 33},
                                    {1, 100003, 1}, {3, 40001, 1}, {1, 4096, 768}, {4, 999, 17},
                                    {2, 3, 1025},   {1, 0, 4}};

std::vector<float> uniform(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Both sides accumulate in double (error ~n 2^-53 of sum |x|) and round once to float: they
// differ by at most one float rounding, 2^-24 |y|, plus the double error, far below 1e-12 sum|x|.
TEST(Reduce, SumAxisMatchesReference) {
  for (auto [outer, n, inner] : kShapes) {
    const auto x = uniform(outer * n * inner, 21);
    std::vector<float> y(outer * inner, -1.0f), want(outer * inner);
    sum_axis(x.data(), y.data(), outer, n, inner);
    ref::sum_axis(x.data(), want.data(), outer, n, inner);
    for (int64_t k = 0; k < outer * inner; ++k) {
      double abs_sum = 0.0;
      const int64_t o = k / inner, j = k % inner;
      for (int64_t r = 0; r < n; ++r) abs_sum += std::fabs(x[(o * n + r) * inner + j]);
      ASSERT_NEAR(y[k], want[k], 0x1p-24 * std::fabs(want[k]) + 1e-12 * abs_sum)
          << outer << "x" << n << "x" << inner << " k=" << k;
    }
  }
}

// Double accumulation of at most 1e6 squares: relative error ~1e-13 against a sequential sum.
TEST(Reduce, SumSquaresMatchesLoop) {
  for (int64_t n : {0, 1, 7, 15, 17, 1000003}) {
    const auto x = uniform(n, 22);
    double want = 0.0;
    for (float v : x) want += static_cast<double>(v) * v;
    EXPECT_NEAR(sum_squares(x.data(), n), want, 1e-12 * want) << "n=" << n;
  }
}

TEST(Reduce, DeterministicAcrossThreadCounts) {
  const int saved = omp_get_max_threads();
  for (auto [outer, n, inner] : kShapes) {
    const auto x = uniform(outer * n * inner, 23);
    std::vector<float> y1(outer * inner), y2(outer * inner);
    omp_set_num_threads(1);
    sum_axis(x.data(), y1.data(), outer, n, inner);
    const double s1 = sum_squares(x.data(), outer * n * inner);
    omp_set_num_threads(2);
    sum_axis(x.data(), y2.data(), outer, n, inner);
    const double s2 = sum_squares(x.data(), outer * n * inner);
    EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)), 0)
        << outer << "x" << n << "x" << inner;
    EXPECT_EQ(std::memcmp(&s1, &s2, sizeof(double)), 0) << outer << "x" << n << "x" << inner;
  }
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace kuai::cpu
