// Tests of the fp32 LayerNorm kernels against the double-precision reference: odd shapes, rows
// with a large common offset (catastrophic cancellation in a naive E[x^2] - E[x]^2), and dw/db
// that must be bit-identical whatever the thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"

namespace {

constexpr float kEps = 1e-5f;
constexpr double kUlp = FLT_EPSILON;  // 2^-23

using kuai::test::uniform;

struct Shape {
  int64_t N, C;
};

// Rows are offset + U(-spread, spread).
void check_forward(Shape s, float offset, float spread, uint32_t seed) {
  const auto [N, C] = s;
  SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C << " offset=" << offset);
  auto x = uniform(N * C, offset - spread, offset + spread, seed);  // (N, C)
  auto w = uniform(C, 0.5f, 1.5f, seed + 1);
  auto b = uniform(C, -0.5f, 0.5f, seed + 2);
  std::vector<float> y(N * C), mean(N), rstd(N), y_ref(N * C), mean_ref(N), rstd_ref(N);
  kuai::cpu::layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), N,
                                C, kEps);
  kuai::cpu::ref::layer_norm_forward(x.data(), w.data(), b.data(), y_ref.data(), mean_ref.data(),
                                     rstd_ref.data(), N, C, kEps);
  // The kernel sums a row in float over 32 lanes of about C / 32 terms each and then across the
  // lanes: the worst-case relative error of such a sum is (C / 32 + 32) eps, plus a few eps for
  // the surrounding arithmetic. The double reference is exact at that scale.
  const double rel = (static_cast<double>(C) / 32 + 40) * kUlp;
  for (int64_t i = 0; i < N; ++i) {
    const double sd = 1.0 / rstd_ref[i];  // ~ row standard deviation (or sqrt(eps))
    // mean: a float rounding (half an ulp of |mean|) plus the sum error relative to the spread.
    EXPECT_NEAR(mean[i], mean_ref[i], kUlp * std::fabs(mean_ref[i]) + rel * sd) << "row " << i;
    // rstd: relative error of the variance sum, halved by the square root, plus a rounding.
    EXPECT_NEAR(rstd[i], rstd_ref[i], rel * rstd_ref[i]) << "row " << i;
    for (int64_t c = 0; c < C; ++c) {
      // y = xhat * w + b: xhat * w carries the relative error of rstd, plus the mean's error
      // over sd (bounded by rel) times w (< 1.5); adding b costs a rounding or two.
      const double xhat_w = std::fabs(y_ref[i * C + c] - b[c]);
      const double tol = rel * (xhat_w + 1.5) + 2 * kUlp * std::fabs(b[c]);
      ASSERT_NEAR(y[i * C + c], y_ref[i * C + c], tol) << "row " << i << " col " << c;
    }
  }
}

TEST(LayerNormForward, MatchesReferenceOnOddShapes) {
  const Shape shapes[] = {{1, 1},    {1, 7},    {3, 17},    {5, 33},  {7, 1},
                          {64, 768}, {100, 40}, {257, 129}, {2, 4096}};
  uint32_t seed = 10;
  for (Shape s : shapes) check_forward(s, 0.0f, 2.0f, seed++);
}

TEST(LayerNormForward, OffsetMeanKeepsPrecision) {
  // Values 1000 +- 1: a one-pass E[x^2] - E[x]^2 in float loses every digit of the variance.
  const Shape shapes[] = {{3, 17}, {5, 33}, {64, 768}, {4, 4096}};
  uint32_t seed = 30;
  for (Shape s : shapes) check_forward(s, 1000.0f, 1.0f, seed++);
  check_forward({8, 100}, -5.0e4f, 0.01f, 40);
}

TEST(LayerNormForward, ConstantRowGivesBias) {
  const int64_t C = 19;
  std::vector<float> x(C, 3.25f), w(C, 2.0f), b = uniform(C, -1.0f, 1.0f, 5), y(C);
  float mean = 0.0f, rstd = 0.0f;
  kuai::cpu::layer_norm_forward(x.data(), w.data(), b.data(), y.data(), &mean, &rstd, 1, C, kEps);
  EXPECT_EQ(mean, 3.25f);
  EXPECT_FLOAT_EQ(rstd, 1.0f / std::sqrt(kEps));
  for (int64_t c = 0; c < C; ++c) EXPECT_EQ(y[c], b[c]);
}

struct Grads {
  std::vector<float> dx, dw, db;
};

Grads run_backward(const std::vector<float>& dy, const std::vector<float>& x,
                   const std::vector<float>& w, const std::vector<float>& mean,
                   const std::vector<float>& rstd, Shape s) {
  Grads g{std::vector<float>(s.N * s.C), std::vector<float>(s.C, NAN),
          std::vector<float>(s.C, NAN)};
  kuai::cpu::layer_norm_backward(dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                 g.dx.data(), g.dw.data(), g.db.data(), s.N, s.C);
  return g;
}

void check_backward(Shape s, float offset, uint32_t seed) {
  const auto [N, C] = s;
  SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C << " offset=" << offset);
  auto x = uniform(N * C, offset - 1.0f, offset + 1.0f, seed);  // (N, C)
  auto dy = uniform(N * C, -1.0f, 1.0f, seed + 1);              // (N, C)
  auto w = uniform(C, 0.5f, 1.5f, seed + 2);
  auto b = uniform(C, -0.5f, 0.5f, seed + 3);
  std::vector<float> y(N * C), mean(N), rstd(N);
  kuai::cpu::ref::layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(),
                                     rstd.data(), N, C, kEps);
  Grads g = run_backward(dy, x, w, mean, rstd, s);
  std::vector<float> dx_ref(N * C), dw_ref(C), db_ref(C);
  kuai::cpu::ref::layer_norm_backward(dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                      dx_ref.data(), dw_ref.data(), db_ref.data(), N, C);

  // dx: per row two float sums of C terms (32 lanes, as in the forward), then
  // rstd * (dy w - m1 - xhat m2). Bound: (C / 32 + 40) eps times the size of those terms.
  const double rel_c = (static_cast<double>(C) / 32 + 40) * kUlp;
  for (int64_t i = 0; i < N; ++i) {
    double m1 = 0.0, m2 = 0.0;  // mean |dxhat|, mean |dxhat * xhat|
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (static_cast<double>(x[i * C + c]) - mean[i]) * rstd[i];
      m1 += std::fabs(dy[i * C + c] * w[c]) / C;
      m2 += std::fabs(dy[i * C + c] * w[c] * xhat) / C;
    }
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (static_cast<double>(x[i * C + c]) - mean[i]) * rstd[i];
      const double scale = rstd[i] * (std::fabs(dy[i * C + c] * w[c]) + m1 + std::fabs(xhat) * m2);
      ASSERT_NEAR(g.dx[i * C + c], dx_ref[i * C + c], rel_c * scale + 1e-30)
          << "row " << i << " col " << c;
    }
  }
  // dw, db: sums over N rows, done as float sums over blocks of at most N / 64 + 8 rows and then
  // over at most 64 block partials. Worst-case error (N / 64 + 8 + 64) eps times sum |term|,
  // plus a few eps per term for xhat.
  const double rel_n = (static_cast<double>(N) / 64 + 8 + 64 + 8) * kUlp;
  for (int64_t c = 0; c < C; ++c) {
    double abs_dw = 0.0, abs_db = 0.0;
    for (int64_t i = 0; i < N; ++i) {
      const double xhat = (static_cast<double>(x[i * C + c]) - mean[i]) * rstd[i];
      abs_dw += std::fabs(dy[i * C + c] * xhat);
      abs_db += std::fabs(dy[i * C + c]);
    }
    EXPECT_NEAR(g.dw[c], dw_ref[c], rel_n * abs_dw) << "col " << c;
    EXPECT_NEAR(g.db[c], db_ref[c], rel_n * abs_db) << "col " << c;
  }
}

TEST(LayerNormBackward, MatchesReferenceOnOddShapes) {
  const Shape shapes[] = {{1, 1},    {1, 7},    {3, 17},    {5, 33},  {7, 1},
                          {64, 768}, {100, 40}, {513, 129}, {2, 4096}};
  uint32_t seed = 50;
  for (Shape s : shapes) check_backward(s, 0.0f, seed++);
}

TEST(LayerNormBackward, OffsetMeanKeepsPrecision) {
  const Shape shapes[] = {{5, 33}, {64, 768}};
  uint32_t seed = 70;
  for (Shape s : shapes) check_backward(s, 1000.0f, seed++);
}

TEST(LayerNormBackward, BitIdenticalAcrossThreadCounts) {
  const Shape s{1031, 200};  // above the parallel threshold, N not a multiple of the blocks
  auto x = uniform(s.N * s.C, -2.0f, 2.0f, 90);
  auto dy = uniform(s.N * s.C, -1.0f, 1.0f, 91);
  auto w = uniform(s.C, 0.5f, 1.5f, 92);
  auto b = uniform(s.C, -0.5f, 0.5f, 93);
  std::vector<float> y(s.N * s.C), mean(s.N), rstd(s.N);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  kuai::cpu::layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(),
                                s.N, s.C, kEps);
  Grads one = run_backward(dy, x, w, mean, rstd, s);
  std::vector<float> y2(s.N * s.C), mean2(s.N), rstd2(s.N);
  omp_set_num_threads(2);
  kuai::cpu::layer_norm_forward(x.data(), w.data(), b.data(), y2.data(), mean2.data(), rstd2.data(),
                                s.N, s.C, kEps);
  Grads two = run_backward(dy, x, w, mean, rstd, s);
  omp_set_num_threads(saved);
  EXPECT_EQ(y, y2);
  EXPECT_EQ(mean, mean2);
  EXPECT_EQ(rstd, rstd2);
  EXPECT_EQ(one.dx, two.dx);
  EXPECT_EQ(one.dw, two.dw);
  EXPECT_EQ(one.db, two.db);
}

}  // namespace
