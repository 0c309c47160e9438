// Tests of the fused softmax + cross-entropy kernels against the double-precision reference: odd
// vocabulary sizes, logits of large magnitude, masked (-inf) logits, ignored rows, bad targets,
// and results that do not depend on the thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"

namespace {

constexpr int32_t kIgnore = -100;
constexpr double kUlp = FLT_EPSILON;  // 2^-23

using kuai::test::uniform;

// Targets in [0, V); every `ignore_every`-th row (if > 0) gets `ignore`.
std::vector<int32_t> targets_for(int64_t N, int64_t V, int ignore_every, int32_t ignore,
                                 uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> t(N);
  for (int64_t i = 0; i < N; ++i)
    t[i] = ignore_every > 0 && i % ignore_every == 1 ? ignore : dist(gen);
  return t;
}

// Worst-case error of the kernel's logsumexp: each of 16 lanes sums about V / 16 positive terms in
// float (relative error (V / 16 + 16) eps for the sum, which is the absolute error of its log),
// each term has the few-ulp error of the fast exp, and the stored lse is rounded to float.
double lse_tol(int64_t V, double lse) {
  return (static_cast<double>(V) / 16 + 16 + 4) * kUlp + kUlp * std::fabs(lse);
}

void check(int64_t N, int64_t V, float lo, float hi, int ignore_every, int32_t ignore,
           uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "N=" << N << " V=" << V << " logits in [" << lo << ", " << hi
                                  << "] ignore_index=" << ignore);
  auto logits = uniform(N * V, lo, hi, seed);  // (N, V)
  auto targets = targets_for(N, V, ignore_every, ignore, seed + 1);
  std::vector<float> lse(N), lse_ref(N);
  int64_t count = -1, count_ref = -2;
  const double loss = kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), N,
                                                       V, ignore, &count);
  const double loss_ref = kuai::cpu::ref::cross_entropy_forward(
      logits.data(), targets.data(), lse_ref.data(), N, V, ignore, &count_ref);
  EXPECT_EQ(count, count_ref);
  double loss_tol = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_NEAR(lse[i], lse_ref[i], lse_tol(V, lse_ref[i])) << "row " << i;
    // The loss uses the kernel's unrounded (double) lse, so no float rounding of lse enters.
    if (targets[i] != ignore) loss_tol += lse_tol(V, 0.0);
  }
  EXPECT_NEAR(loss, loss_ref, loss_tol);

  const float grad_scale = 1.0f / static_cast<float>(N);
  std::vector<float> d(N * V, NAN), d_ref(N * V);
  // Both take the same (kernel) lse, so only the backward's own error is measured.
  kuai::cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), d.data(), N, V,
                                    ignore, grad_scale);
  kuai::cpu::ref::cross_entropy_backward(logits.data(), targets.data(), lse.data(), d_ref.data(), N,
                                         V, ignore, grad_scale);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < V; ++c) {
      const double p = std::fabs(d_ref[i * V + c]) / grad_scale;
      // p = exp(x - lse): x - lse is rounded to float (an ulp of max(|x|, |lse|) in the exponent,
      // i.e. that much relative error in p), exp adds a few ulp, then one product. The fast exp
      // flushes results below FLT_MIN to zero (no subnormals), hence the FLT_MIN floor.
      const double mag = std::fmax(std::fabs(logits[i * V + c]), std::fabs(lse[i]));
      const double tol =
          (p + (c == targets[i] ? 1.0 : 0.0)) * (mag + 4) * kUlp * grad_scale + FLT_MIN;
      ASSERT_NEAR(d[i * V + c], d_ref[i * V + c], tol) << "row " << i << " col " << c;
    }
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] != ignore) continue;
    for (int64_t c = 0; c < V; ++c) ASSERT_EQ(d[i * V + c], 0.0f) << "ignored row " << i;
  }
}

TEST(CrossEntropy, MatchesReferenceOnOddShapes) {
  const int64_t shapes[][2] = {{1, 1},   {1, 5},    {3, 17},    {5, 33},
                               {7, 100}, {64, 768}, {600, 256}, {4, 50257}};
  uint32_t seed = 100;
  for (auto [N, V] : shapes) check(N, V, -8.0f, 8.0f, 0, kIgnore, seed++);
}

TEST(CrossEntropy, LargeMagnitudeLogits) {
  const int64_t shapes[][2] = {{3, 17}, {5, 33}, {64, 768}, {2, 50257}};
  uint32_t seed = 200;
  for (auto [N, V] : shapes) check(N, V, -100.0f, 100.0f, 0, kIgnore, seed++);
  check(16, 40, 900.0f, 1000.0f, 0, kIgnore, seed++);
}

TEST(CrossEntropy, IgnoredRows) {
  check(37, 65, -5.0f, 5.0f, 3, kIgnore, 300);
  check(600, 256, -5.0f, 5.0f, 4, kIgnore, 301);
  // An ignore_index inside [0, V) skips rows whose target is that class.
  check(50, 3, -5.0f, 5.0f, 2, 1, 302);
}

TEST(CrossEntropy, AllRowsIgnored) {
  const int64_t N = 4, V = 9;
  auto logits = uniform(N * V, -1.0f, 1.0f, 400);
  std::vector<int32_t> targets(N, kIgnore);
  std::vector<float> lse(N), d(N * V, 1.0f);
  int64_t count = -1;
  EXPECT_EQ(kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), N, V,
                                             kIgnore, &count),
            0.0);
  EXPECT_EQ(count, 0);
  kuai::cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), d.data(), N, V,
                                    kIgnore, 1.0f);
  for (float g : d) EXPECT_EQ(g, 0.0f);
}

TEST(CrossEntropy, MaskedLogits) {
  // -inf logits (masked classes), including the first and last column of a row.
  const int64_t N = 3, V = 37;
  auto logits = uniform(N * V, -3.0f, 3.0f, 500);
  for (int64_t c = 0; c < V; c += 3) logits[c] = -INFINITY;
  logits[V] = -INFINITY;
  logits[2 * V - 1] = -INFINITY;
  const std::vector<int32_t> targets = {1, 5, 20};
  std::vector<float> lse(N), lse_ref(N), d(N * V), d_ref(N * V);
  int64_t count = 0, count_ref = 0;
  const double loss = kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), N,
                                                       V, kIgnore, &count);
  const double loss_ref = kuai::cpu::ref::cross_entropy_forward(
      logits.data(), targets.data(), lse_ref.data(), N, V, kIgnore, &count_ref);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(loss, loss_ref, N * lse_tol(V, 0.0));
  kuai::cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), d.data(), N, V,
                                    kIgnore, 1.0f);
  kuai::cpu::ref::cross_entropy_backward(logits.data(), targets.data(), lse.data(), d_ref.data(), N,
                                         V, kIgnore, 1.0f);
  for (int64_t k = 0; k < N * V; ++k) {
    if (std::isinf(logits[k])) {
      EXPECT_EQ(d[k], 0.0f) << k;
    } else {
      EXPECT_NEAR(d[k], d_ref[k], 8 * kUlp) << k;  // p <= 1, |x|, |lse| < 8: a few ulp of 1
    }
  }
}

TEST(CrossEntropy, NanLogitPropagates) {
  const int64_t N = 2, V = 40;  // the NaN sits in the vector part of row 0, the tail of row 1
  auto logits = uniform(N * V, -1.0f, 1.0f, 550);
  logits[3] = NAN;
  logits[V + 38] = NAN;
  const std::vector<int32_t> targets = {0, 1};
  std::vector<float> lse(N);
  int64_t count = 0;
  const double loss = kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), N,
                                                       V, kIgnore, &count);
  EXPECT_TRUE(std::isnan(lse[0]));
  EXPECT_TRUE(std::isnan(lse[1]));
  EXPECT_TRUE(std::isnan(loss));
}

TEST(CrossEntropy, TargetOutOfRangeThrows) {
  const int64_t N = 4, V = 10;
  auto logits = uniform(N * V, -1.0f, 1.0f, 600);
  std::vector<float> lse(N), d(N * V);
  int64_t count = 0;
  for (int32_t bad : {10, -1, 12345}) {
    const std::vector<int32_t> targets = {0, kIgnore, bad, 9};
    try {
      kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), N, V, kIgnore,
                                       &count);
      ADD_FAILURE() << "no throw for target " << bad;
    } catch (const std::out_of_range& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
    }
    EXPECT_THROW(kuai::cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(),
                                                   d.data(), N, V, kIgnore, 1.0f),
                 std::out_of_range);
  }
}

TEST(CrossEntropy, BitIdenticalAcrossThreadCounts) {
  const int64_t N = 301, V = 1000;  // above the parallel threshold, odd row count
  auto logits = uniform(N * V, -10.0f, 10.0f, 700);
  auto targets = targets_for(N, V, 5, kIgnore, 701);
  std::vector<float> lse1(N), lse2(N), d1(N * V), d2(N * V);
  int64_t c1 = 0, c2 = 0;
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const double l1 = kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse1.data(), N,
                                                     V, kIgnore, &c1);
  kuai::cpu::cross_entropy_backward(logits.data(), targets.data(), lse1.data(), d1.data(), N, V,
                                    kIgnore, 0.5f);
  omp_set_num_threads(2);
  const double l2 = kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse2.data(), N,
                                                     V, kIgnore, &c2);
  kuai::cpu::cross_entropy_backward(logits.data(), targets.data(), lse2.data(), d2.data(), N, V,
                                    kIgnore, 0.5f);
  omp_set_num_threads(saved);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(c1, c2);
  EXPECT_EQ(lse1, lse2);
  EXPECT_EQ(d1, d2);
}

}  // namespace
