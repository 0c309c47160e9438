// Tests for kuai::cpu::gemm and gemm_batched: every transpose combination, both forced backends
// and the automatic choice, odd shapes, padded leading dimensions, alpha != 1, beta 0 and 1,
// strided attention-style batches, all against the double-accumulated gemm_reference.
#include <gtest/gtest.h>
#include <omp.h>

#include <unistd.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kuai/backend/cpu/gemm/blocked.h"
#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/core/allocator.h"

namespace kuai::cpu {
namespace {

// Tolerance. fp32 dot products of length K have a worst-case rounding error of about
// K * u * sum|a_p b_p| (u = 2^-24 ~ 6e-8) and a typical one of sqrt(K) * u * sum|a_p b_p|.
// We require |got - ref| <= 1e-5 * sqrt(K) * (|alpha| sum_p |a_p b_p| + |beta c|): that is about
// 170 u sqrt(K), which covers the worst case K u for every K <= 28000 (so it is never flaky on
// any blocking or FMA order a backend picks) while an indexing or transpose bug gives O(1)
// relative errors and fails it by orders of magnitude.
constexpr double kTolPerSqrtK = 1e-5;

std::vector<float> random_buffer(int64_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(size));
  for (float& x : v) x = dist(rng);
  return v;
}

// Checks C against the reference product computed from the same inputs and initial C.
void expect_close(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                  int64_t lda, const float* B, int64_t ldb, float beta, const float* c_init,
                  const float* got, const float* want, int64_t ldc, const std::string& what) {
  const double tol = kTolPerSqrtK * std::sqrt(static_cast<double>(std::max<int64_t>(K, 1)));
  int failures = 0;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double magnitude = 0.0;
      for (int64_t p = 0; p < K; ++p) {
        const double a = ta ? A[p * lda + i] : A[i * lda + p];
        const double b = tb ? B[j * ldb + p] : B[p * ldb + j];
        magnitude += std::abs(a * b);
      }
      magnitude *= std::abs(alpha);
      if (beta != 0.0f) magnitude += std::abs(beta * c_init[i * ldc + j]);
      const double g = got[i * ldc + j], w = want[i * ldc + j];
      const bool ok = std::isfinite(g) && std::abs(g - w) <= tol * magnitude + 1e-30;
      if (!ok && failures++ < 3) {
        ADD_FAILURE() << what << " at (" << i << "," << j << "): got " << g << " want " << w
                      << " bound " << tol * magnitude;
      }
    }
  }
}

struct Shape {
  int64_t m, n, k;
  int64_t pad;  // extra elements on every leading dimension beyond the minimum
};

const Shape kShapes[] = {{1, 1, 1, 0},     {1, 17, 3, 0},   {17, 1, 5, 0},
                         {33, 65, 129, 0}, {1, 64, 256, 0}, {1, 300, 40, 5},
                         {33, 65, 129, 7}, {64, 48, 96, 3}, {7, 9, 1, 0}};

const GemmBackend kBackends[] = {GemmBackend::kAuto, GemmBackend::kOpenBLAS, GemmBackend::kOneDNN,
                                 GemmBackend::kKuai};

std::string backend_label(GemmBackend b) {
  switch (b) {
    case GemmBackend::kAuto:
      return "auto";
    case GemmBackend::kOpenBLAS:
      return "openblas";
    case GemmBackend::kOneDNN:
      return "onednn";
    case GemmBackend::kKuai:
      break;
  }
  return "kuai";
}

// Restores the automatic backend choice whatever a test forced.
class GemmTest : public ::testing::Test {
 protected:
  void TearDown() override { set_gemm_backend(GemmBackend::kAuto); }
};

// One product in every configuration: initialises C (NaN garbage when beta == 0), runs gemm and
// the reference, and compares.
void check_gemm(GemmBackend backend, bool ta, bool tb, const Shape& s, float alpha, float beta) {
  const int64_t lda = (ta ? s.m : s.k) + s.pad, ldb = (tb ? s.k : s.n) + s.pad, ldc = s.n + s.pad;
  const std::vector<float> a = random_buffer((ta ? s.k : s.m) * lda, 11);
  const std::vector<float> b = random_buffer((tb ? s.n : s.k) * ldb, 12);
  std::vector<float> c = random_buffer(s.m * ldc, 13);
  if (beta == 0.0f) c.assign(c.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> got = c, want = c;
  set_gemm_backend(backend);
  gemm(ta, tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta, got.data(), ldc);
  gemm_reference(ta, tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta, want.data(),
                 ldc);
  const std::string what = backend_label(backend) + (ta ? " T" : " N") + (tb ? "T" : "N") + " " +
                           std::to_string(s.m) + "x" + std::to_string(s.n) + "x" +
                           std::to_string(s.k) + " pad " + std::to_string(s.pad) + " alpha " +
                           std::to_string(alpha) + " beta " + std::to_string(beta);
  expect_close(ta, tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(),
               got.data(), want.data(), ldc, what);
  // Padding columns of C beyond N must be untouched.
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = s.n; j < ldc; ++j) {
      const float before = c[i * ldc + j], after = got[i * ldc + j];
      EXPECT_TRUE(before == after || (std::isnan(before) && std::isnan(after))) << what;
    }
  }
}

TEST_F(GemmTest, AllTransposesBackendsShapesAndScalars) {
  const std::tuple<float, float> scalars[] = {
      {1.0f, 0.0f}, {1.0f, 1.0f}, {0.37f, 0.0f}, {-1.5f, 1.0f}};
  for (GemmBackend backend : kBackends) {
    for (int t = 0; t < 4; ++t) {
      for (const Shape& s : kShapes) {
        for (auto [alpha, beta] : scalars) check_gemm(backend, t & 1, t & 2, s, alpha, beta);
      }
    }
  }
}

TEST_F(GemmTest, TrainingShapesMatchReference) {
  // A GPT-like linear layer: forward (NT, beta=1 onto a bias), dX (NN), dW (TN, accumulating).
  const int64_t M = 96, C = 64, H = 256;
  for (GemmBackend backend : kBackends) {
    check_gemm(backend, false, true, {M, H, C, 0}, 1.0f, 1.0f);
    check_gemm(backend, false, false, {M, C, H, 0}, 1.0f, 0.0f);
    check_gemm(backend, true, false, {H, C, M, 0}, 1.0f, 1.0f);
  }
}

TEST_F(GemmTest, BetaZeroIgnoresNaNAndOtherBetaScales) {
  for (GemmBackend backend : kBackends) {
    check_gemm(backend, false, false, {5, 6, 7, 2}, 1.0f, 0.5f);
    check_gemm(backend, true, true, {5, 6, 7, 2}, 2.0f, -0.25f);
  }
}

TEST_F(GemmTest, EmptyInnerDimensionScalesC) {
  for (GemmBackend backend : kBackends) {
    set_gemm_backend(backend);
    std::vector<float> c = {1.0f, 2.0f, 3.0f, 4.0f};
    gemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.5f, c.data(), 2);
    EXPECT_EQ(c, (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f}));
    std::vector<float> nan(4, std::numeric_limits<float>::quiet_NaN());
    gemm(false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.0f, nan.data(), 2);
    EXPECT_EQ(nan, (std::vector<float>(4, 0.0f)));
  }
}

// Attention-shaped batches: q/k/v are column slices of a (B,T,3C) tensor (row stride 3C), scores
// are (B,H,T,T), and outputs land in column slices of a (B,T,C) tensor.
void check_attention_batch(GemmBackend backend, int64_t B, int64_t H, int64_t T, int64_t D,
                           float beta) {
  const int64_t C = H * D, count = B * H;
  const std::vector<float> qkv = random_buffer(B * T * 3 * C, 21);
  std::vector<int64_t> q_off, k_off, v_off, s_off, y_off;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      q_off.push_back(b * T * 3 * C + h * D);
      k_off.push_back(b * T * 3 * C + C + h * D);
      v_off.push_back(b * T * 3 * C + 2 * C + h * D);
      s_off.push_back((b * H + h) * T * T);
      y_off.push_back(b * T * C + h * D);
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  set_gemm_backend(backend);
  const std::string label = backend_label(backend) + " B" + std::to_string(B) + " H" +
                            std::to_string(H) + " T" + std::to_string(T) + " D" +
                            std::to_string(D) + " beta " + std::to_string(beta);

  // Scores: S = scale * Q K^T (NT).
  std::vector<float> s_init = random_buffer(count * T * T, 22);
  if (beta == 0.0f) s_init.assign(s_init.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> s_got = s_init, s_want = s_init;
  gemm_batched(false, true, T, T, D, scale, qkv.data(), 3 * C, q_off.data(), qkv.data(), 3 * C,
               k_off.data(), beta, s_got.data(), T, s_off.data(), count);
  for (int64_t i = 0; i < count; ++i) {
    gemm_reference(false, true, T, T, D, scale, qkv.data() + q_off[i], 3 * C, qkv.data() + k_off[i],
                   3 * C, beta, s_want.data() + s_off[i], T);
    expect_close(false, true, T, T, D, scale, qkv.data() + q_off[i], 3 * C, qkv.data() + k_off[i],
                 3 * C, beta, s_init.data() + s_off[i], s_got.data() + s_off[i],
                 s_want.data() + s_off[i], T, "scores " + label);
  }

  // Values: Y = P V (NN), written into column slices of (B,T,C).
  const std::vector<float> p = random_buffer(count * T * T, 23);
  std::vector<float> y_init = random_buffer(B * T * C, 24);
  if (beta == 0.0f) y_init.assign(y_init.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> y_got = y_init, y_want = y_init;
  gemm_batched(false, false, T, D, T, 1.0f, p.data(), T, s_off.data(), qkv.data(), 3 * C,
               v_off.data(), beta, y_got.data(), C, y_off.data(), count);
  for (int64_t i = 0; i < count; ++i) {
    gemm_reference(false, false, T, D, T, 1.0f, p.data() + s_off[i], T, qkv.data() + v_off[i],
                   3 * C, beta, y_want.data() + y_off[i], C);
  }
  for (int64_t i = 0; i < count; ++i) {
    expect_close(false, false, T, D, T, 1.0f, p.data() + s_off[i], T, qkv.data() + v_off[i], 3 * C,
                 beta, y_init.data() + y_off[i], y_got.data() + y_off[i], y_want.data() + y_off[i],
                 C, "values " + label);
  }

  // Value gradient: dV = P^T dY (TN), dY read from column slices of (B,T,C) and dV written into
  // the v slices of a (B,T,3C) gradient.
  std::vector<float> g_init = random_buffer(B * T * 3 * C, 25);
  if (beta == 0.0f) g_init.assign(g_init.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> g_got = g_init, g_want = g_init;
  gemm_batched(true, false, T, D, T, 0.5f, p.data(), T, s_off.data(), y_want.data(), C,
               y_off.data(), beta, g_got.data(), 3 * C, v_off.data(), count);
  for (int64_t i = 0; i < count; ++i) {
    gemm_reference(true, false, T, D, T, 0.5f, p.data() + s_off[i], T, y_want.data() + y_off[i], C,
                   beta, g_want.data() + v_off[i], 3 * C);
  }
  for (int64_t i = 0; i < count; ++i) {
    expect_close(true, false, T, D, T, 0.5f, p.data() + s_off[i], T, y_want.data() + y_off[i], C,
                 beta, g_init.data() + v_off[i], g_got.data() + v_off[i], g_want.data() + v_off[i],
                 3 * C, "value grad " + label);
  }
}

// Both operands transposed, contiguous batch with gaps between matrices.
void check_batched_tt(GemmBackend backend, int64_t M, int64_t N, int64_t K, int64_t count) {
  const int64_t a_size = K * M + 3, b_size = N * K + 5, c_size = M * N + 1;
  const std::vector<float> a = random_buffer(count * a_size, 41);
  const std::vector<float> b = random_buffer(count * b_size, 42);
  std::vector<float> c_init = random_buffer(count * c_size, 43);
  std::vector<float> got = c_init, want = c_init;
  std::vector<int64_t> a_off, b_off, c_off;
  for (int64_t i = 0; i < count; ++i) {
    a_off.push_back((count - 1 - i) * a_size);  // arbitrary order, not monotone
    b_off.push_back(i * b_size);
    c_off.push_back(i * c_size);
  }
  set_gemm_backend(backend);
  gemm_batched(true, true, M, N, K, -0.75f, a.data(), M, a_off.data(), b.data(), K, b_off.data(),
               1.0f, got.data(), N, c_off.data(), count);
  for (int64_t i = 0; i < count; ++i) {
    gemm_reference(true, true, M, N, K, -0.75f, a.data() + a_off[i], M, b.data() + b_off[i], K,
                   1.0f, want.data() + c_off[i], N);
    expect_close(true, true, M, N, K, -0.75f, a.data() + a_off[i], M, b.data() + b_off[i], K, 1.0f,
                 c_init.data() + c_off[i], got.data() + c_off[i], want.data() + c_off[i], N,
                 "batched TT " + backend_label(backend));
  }
}

TEST_F(GemmTest, BatchedAttentionSlicesMatchReference) {
  for (GemmBackend backend : kBackends) {
    for (float beta : {0.0f, 1.0f}) {
      check_attention_batch(backend, 2, 3, 17, 8, beta);
      check_attention_batch(backend, 1, 1, 33, 16, beta);  // batch of one: the loop path
    }
    check_batched_tt(backend, 9, 13, 21, 5);
    check_batched_tt(backend, 1, 1, 1, 3);
  }
}

TEST_F(GemmTest, GemmInsideParallelRegionMatchesReference) {
  // Callers may already be inside an OpenMP region; each product must still be complete.
  for (GemmBackend backend : kBackends) {
    set_gemm_backend(backend);
    const int64_t M = 40, N = 36, K = 52, count = 6;
    const std::vector<float> a = random_buffer(count * M * K, 31);
    const std::vector<float> b = random_buffer(count * K * N, 32);
    std::vector<float> got(count * M * N, std::numeric_limits<float>::quiet_NaN());
    std::vector<float> want = got;
#pragma omp parallel for num_threads(2)
    for (int64_t i = 0; i < count; ++i) {
      gemm(false, false, M, N, K, 1.0f, a.data() + i * M * K, K, b.data() + i * K * N, N, 0.0f,
           got.data() + i * M * N, N);
    }
    for (int64_t i = 0; i < count; ++i) {
      gemm_reference(false, false, M, N, K, 1.0f, a.data() + i * M * K, K, b.data() + i * K * N, N,
                     0.0f, want.data() + i * M * N, N);
      expect_close(false, false, M, N, K, 1.0f, a.data() + i * M * K, K, b.data() + i * K * N, N,
                   0.0f, want.data(), got.data() + i * M * N, want.data() + i * M * N, N,
                   "in-region " + backend_label(backend));
    }
  }
}

// oneDNN over slices of K (the router's candidates for a long K): K 9001 in slices of about 4096
// (3008, 3008, 2985) and 1024 (9 of 1024, then 809), every transpose, beta 0 over NaN and beta
// 1, padded leading dimensions.
TEST_F(GemmTest, SplitKMatchesReference) {
  const int64_t M = 7, N = 13, K = 9001, pad = 3;
  for (int t = 0; t < 8; ++t) {
    const int64_t slice = t < 4 ? 4096 : 1024;
    const bool ta = t & 1, tb = t & 2;
    for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{-1.5f, 1.0f}}) {
      const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
      const std::vector<float> a = random_buffer((ta ? K : M) * lda, 21);
      const std::vector<float> b = random_buffer((tb ? N : K) * ldb, 22);
      std::vector<float> c = random_buffer(M * ldc, 23);
      if (beta == 0.0f) c.assign(c.size(), std::numeric_limits<float>::quiet_NaN());
      std::vector<float> got = c, want = c;
      gemm_split_k(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, got.data(), ldc,
                   slice);
      gemm_reference(ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, want.data(), ldc);
      expect_close(
          ta, tb, M, N, K, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), got.data(),
          want.data(), ldc,
          std::string("split K ") + std::to_string(slice) + (ta ? " T" : " N") + (tb ? "T" : "N"));
    }
  }
}

// A long-K product is offered to the router with the split-K candidates; when one measures
// fastest (a timer stands in for the clock), gemm() records and runs it, and the result matches
// the reference (C read: beta 1). Products with a short K are not offered them.
TEST_F(GemmTest, ALongKProductMayRunInSlicesOfK) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  std::vector<std::string> offered;
  set_calibration_timer([&](const GemmShape&, const char* name) {
    offered.push_back(name);
    return std::string(name) == "onednn_k4096" ? 1e-3 : 2e-3;
  });
  const int64_t M = 8 + getpid() % 997, N = 8, K = 16500;  // a shape this process measures
  const std::vector<float> a = random_buffer(M * K, 31), b = random_buffer(K * N, 32);
  std::vector<float> c = random_buffer(M * N, 33), want = c;
  const std::vector<float> c_init = c;
  // (A file kept from an earlier run may hold the shape already: then nothing is timed.)
  const bool fresh = !cache.find(routing_key({"gemm", false, false, M, N, K})).has_value();
  gemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 1.0f, c.data(), N);
  set_calibration_timer({});
  if (fresh) {
    EXPECT_EQ(offered, (std::vector<std::string>{"onednn", "openblas", "kuai", "onednn_k1024",
                                                 "onednn_k4096"}));
  }
  EXPECT_EQ(cache.find(routing_key({"gemm", false, false, M, N, K})), "onednn_k4096");
  gemm_reference(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 1.0f, want.data(), N);
  expect_close(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 1.0f, c_init.data(), c.data(),
               want.data(), N, "routed split K");
  // K below twice the smallest slice: no split offered.
  offered.clear();
  set_calibration_timer([&](const GemmShape&, const char* name) {
    offered.push_back(name);
    return 1e-3;
  });
  const int64_t k_short = 2047;
  const std::vector<float> a2 = random_buffer(M * k_short, 34),
                           b2 = random_buffer(k_short * 64, 35);
  std::vector<float> c2(M * 64);
  const bool fresh_short =
      !cache.find(routing_key({"gemm", false, false, M, 64, k_short})).has_value();
  gemm(false, false, M, 64, k_short, 1.0f, a2.data(), k_short, b2.data(), 64, 0.0f, c2.data(), 64);
  set_calibration_timer({});
  if (fresh_short) {
    EXPECT_EQ(offered, (std::vector<std::string>{"onednn", "openblas", "kuai"}));
  }
}

// kuai's blocked GEMM with blocks forced small (MC 12 rows, KC 16, NC 128 columns), so that
// products of a few dozen rows and columns cross every edge: partial row tiles and partial B
// slivers, several row blocks, column panels and K slices (the later slices accumulating), each
// transpose, padded leading dimensions, beta 0 over NaN and beta != 0, alpha != 1; the padding of
// C untouched (check_gemm). The block sizes in force are checked to be the forced ones.
class BlockedGemmTest : public GemmTest {
 protected:
  void SetUp() override { set_blocked_gemm_blocking(12, 16, 128); }
  void TearDown() override {
    set_blocked_gemm_blocking(0, 0, 0);
    GemmTest::TearDown();
  }
};

TEST_F(BlockedGemmTest, EveryBlockingEdgeMatchesReference) {
  const BlockedGemmBlocking blk = blocked_gemm_blocking();
  EXPECT_EQ(blk.kc, 16);
  EXPECT_EQ(blk.mc % blk.mr, 0);
  EXPECT_GE(blk.mc, 12);
  EXPECT_EQ(blk.nc % blk.nr, 0);
  EXPECT_GE(blk.nc, 128);
  for (int64_t m : {1, 5, 6, 7, 13, 25})
    for (int64_t n : {1, 3, 17, 64, 65, 130, 200})
      for (int64_t k : {1, 15, 16, 17, 40})
        for (int t = 0; t < 4; ++t) {
          const int64_t pad = (m + n + k) % 4;
          check_gemm(GemmBackend::kKuai, t & 1, t & 2, {m, n, k, pad}, 1.0f, 0.0f);
          check_gemm(GemmBackend::kKuai, t & 1, t & 2, {m, n, k, pad}, 0.37f, -1.5f);
        }
}

// The bias rides in the first K slice's store only: with K over several slices and a padded C.
TEST_F(BlockedGemmTest, BiasIsAddedOnceOverSeveralSlices) {
  const int64_t M = 19, N = 70, K = 53, ldc = N + 3;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
    const std::vector<float> a = random_buffer(M * K, 41), b = random_buffer(K * N, 42);
    const std::vector<float> bias = random_buffer(N, 43);
    std::vector<float> got(M * ldc, std::numeric_limits<float>::quiet_NaN());
    std::vector<float> want(M * ldc, 0.0f), zeros(M * ldc, 0.0f);
    gemm_blocked(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, got.data(), ldc,
                 bias.data());
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) want[i * ldc + j] = bias[j];
    gemm_reference(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, want.data(), ldc);
    expect_close(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, want.data(), got.data(),
                 want.data(), ldc, "blocked + bias");
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = N; j < ldc; ++j) EXPECT_TRUE(std::isnan(got[i * ldc + j]));
  }
}

// An element's sums depend on K and KC only: the same bits on 1 and 2 threads, inside a parallel
// region (one thread) and outside, with the default blocks and with small ones.
TEST_F(GemmTest, BlockedResultDoesNotDependOnThreads) {
  const int64_t M = 61, N = 150,
                K = 4000;  // K over two or more default slices (KC is at most 2048)
  const std::vector<float> a = random_buffer(M * K, 51), b = random_buffer(K * N, 52);
  for (bool small : {false, true}) {
    if (small) set_blocked_gemm_blocking(12, 16, 128);
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      std::vector<float> runs[3];
      for (int r = 0; r < 3; ++r) {
        runs[r].assign(M * N, 0.5f);
        auto run = [&] {
          gemm_blocked(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, runs[r].data(),
                       N);
        };
        if (r == 0) {
          run();  // the team of omp_get_max_threads()
        } else if (r == 1) {
          const int before = omp_get_max_threads();
          omp_set_num_threads(1);
          run();
          omp_set_num_threads(before);
        } else {
#pragma omp parallel num_threads(2)
          {
#pragma omp single
            run();
          }
        }
      }
      EXPECT_EQ(runs[0], runs[1]) << "t=" << t << " small=" << small;
      EXPECT_EQ(runs[0], runs[2]) << "t=" << t << " small=" << small;
      std::vector<float> want(M * N, 0.5f), init(M * N, 0.5f);
      gemm_reference(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, want.data(), N);
      expect_close(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 1.0f, init.data(),
                   runs[0].data(), want.data(), N, "blocked threads");
    }
  }
  set_blocked_gemm_blocking(0, 0, 0);
}

// The scratch a compiled step's memory plan sets aside for a product on kuai's GEMM is what the
// product takes (this thread's scratch high-water mark, allocations rounded to 64 bytes), for
// each transpose, with default and small blocks, on the team and inside a parallel region; none
// when another backend runs it.
TEST_F(GemmTest, BlockedScratchIsWhatTheFormulaSays) {
  const int64_t M = 75, N = 130, K = 300;
  const std::vector<float> a = random_buffer(M * K, 61), b = random_buffer(K * N, 62);
  std::vector<float> c(M * N);
  auto rounded_sum = [](const std::vector<int64_t>& sizes) {
    int64_t sum = 0;
    for (int64_t s : sizes) sum += (s + 63) / 64 * 64;
    return sum;
  };
  for (bool small : {false, true}) {
    set_blocked_gemm_blocking(small ? 12 : 0, small ? 16 : 0, small ? 128 : 0);
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      ScratchRegion::reset_peak();
      const int64_t before = ScratchRegion::peak();
      gemm_blocked(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), N);
      EXPECT_EQ(ScratchRegion::peak() - before,
                rounded_sum(gemm_blocked_scratch_bytes(ta, tb, M, N, K)))
          << "t=" << t << " small=" << small;
      set_gemm_backend(GemmBackend::kKuai);
      EXPECT_EQ(gemm_scratch_bytes("gemm", ta, tb, M, N, K),
                gemm_blocked_scratch_bytes(ta, tb, M, N, K));
      set_gemm_backend(GemmBackend::kOneDNN);
      EXPECT_TRUE(gemm_scratch_bytes("gemm", ta, tb, M, N, K).empty());
      set_gemm_backend(GemmBackend::kAuto);
      int64_t inside = -1, formula = -2;
#pragma omp parallel num_threads(2)
      {
#pragma omp single
        {
          ScratchRegion::reset_peak();
          const int64_t at = ScratchRegion::peak();
          gemm_blocked(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), N);
          inside = ScratchRegion::peak() - at;
          formula = rounded_sum(gemm_blocked_scratch_bytes(ta, tb, M, N, K));
        }
      }
      EXPECT_EQ(inside, formula) << "in a parallel region, t=" << t << " small=" << small;
    }
  }
  set_blocked_gemm_blocking(0, 0, 0);
}

TEST_F(GemmTest, BackendSelectionRoundTrips) {
  for (GemmBackend backend : kBackends) {
    set_gemm_backend(backend);
    EXPECT_EQ(gemm_backend(), backend);
  }
}

}  // namespace
}  // namespace kuai::cpu

namespace kuai::cpu {
namespace {

// gemm_bias = gemm_reference + bias on every row, on each backend, every transpose case, with a
// padded ldc (the padding must stay untouched). Same tolerance as the other gemm tests.
TEST(GemmBias, MatchesReferencePlusBias) {
  for (GemmBackend backend :
       {GemmBackend::kAuto, GemmBackend::kOneDNN, GemmBackend::kOpenBLAS, GemmBackend::kKuai}) {
    set_gemm_backend(backend);
    for (auto [M, N, K] :
         std::vector<std::array<int64_t, 3>>{{1, 1, 1}, {17, 5, 33}, {64, 96, 7}}) {
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          const int64_t lda = (ta ? M : K) + 1, ldb = (tb ? K : N) + 2, ldc = N + 3;
          std::vector<float> A((ta ? K : M) * lda), B((tb ? N : K) * ldb), bias(N);
          std::vector<float> C(M * ldc, -7.0f), ref(M * ldc, -7.0f);
          for (size_t i = 0; i < A.size(); ++i) A[i] = static_cast<float>((i * 37 % 101) - 50) / 50;
          for (size_t i = 0; i < B.size(); ++i) B[i] = static_cast<float>((i * 53 % 97) - 48) / 48;
          for (int64_t j = 0; j < N; ++j) bias[j] = 0.25f * static_cast<float>(j) - 1.0f;
          gemm_bias(ta, tb, M, N, K, A.data(), lda, B.data(), ldb, bias.data(), C.data(), ldc);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) ref[i * ldc + j] = bias[j];
          gemm_reference(ta, tb, M, N, K, 1.0f, A.data(), lda, B.data(), ldb, 1.0f, ref.data(),
                         ldc);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < ldc; ++j)
              ASSERT_NEAR(C[i * ldc + j], ref[i * ldc + j],
                          1e-5 * std::sqrt(K) * (1 + std::fabs(ref[i * ldc + j])))
                  << M << "x" << N << "x" << K << " ta=" << ta << " tb=" << tb << " (" << i << ","
                  << j << ")";
        }
      }
    }
  }
  set_gemm_backend(GemmBackend::kAuto);
}

}  // namespace
}  // namespace kuai::cpu
