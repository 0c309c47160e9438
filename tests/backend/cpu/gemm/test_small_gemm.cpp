// Tests for the register-blocked small GEMM (gemm/small_gemm.h) and its transpose: every
// transpose case against the double-accumulated gemm_reference over shapes that cut every edge of
// the micro-tile (rows past a multiple of 6, columns past a whole vector and past a 64- or
// 16-column panel, K of 0 and 1), padded leading dimensions, alpha and beta, beta 0 over NaN, C's
// padding untouched; the claim that a result does not depend on where a tile starts; the transpose
// exact. Run at every tier the CPU has by the Tier.* tests (16-, 8- and 4-float vectors).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../../support/random.h"
#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/small_gemm.h"

namespace kuai::cpu {
namespace {

// The gemm tests' bound (test_gemm.cpp says why): |got - ref| <= 1e-5 sqrt(K) (|alpha| sum_p
// |a_p b_p| + |beta c|), some 170 u sqrt(K), above the worst case K u of any summation order for
// these K, while an indexing or transpose bug gives O(1) relative errors.
constexpr double kTolPerSqrtK = 1e-5;

std::vector<float> random_buffer(int64_t size, uint32_t seed) {
  return kuai::test::uniform(size, -1.0f, 1.0f, seed);
}

struct Case {
  bool ta, tb;
  int64_t M, N, K, pad;
  float alpha, beta;
};

std::string label(const Case& c) {
  return std::string(c.ta ? "T" : "N") + (c.tb ? "T" : "N") + " " + std::to_string(c.M) + "x" +
         std::to_string(c.N) + "x" + std::to_string(c.K) + " pad " + std::to_string(c.pad) +
         " alpha " + std::to_string(c.alpha) + " beta " + std::to_string(c.beta);
}

// Runs small_gemm and the reference on the same operands; returns the number of elements out of
// the bound (and of changed padding).
int check(const Case& c) {
  const int64_t lda = (c.ta ? c.M : c.K) + c.pad, ldb = (c.tb ? c.K : c.N) + c.pad;
  const int64_t ldc = c.N + c.pad;
  const std::vector<float> a = random_buffer((c.ta ? c.K : c.M) * lda, 21);
  const std::vector<float> b = random_buffer((c.tb ? c.N : c.K) * ldb, 22);
  std::vector<float> c0 = random_buffer(c.M * ldc, 23);
  if (c.beta == 0.0f) c0.assign(c0.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> got = c0, want = c0;
  std::vector<float> scratch(static_cast<size_t>(small_gemm_scratch_floats(c.tb, c.N, c.K)));
  small_gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, a.data(), lda, b.data(), ldb, c.beta, got.data(),
             ldc, scratch.data());
  gemm_reference(c.ta, c.tb, c.M, c.N, c.K, c.alpha, a.data(), lda, b.data(), ldb, c.beta,
                 want.data(), ldc);
  const double tol = kTolPerSqrtK * std::sqrt(static_cast<double>(std::max<int64_t>(c.K, 1)));
  int bad = 0;
  for (int64_t i = 0; i < c.M; ++i) {
    for (int64_t j = 0; j < c.N; ++j) {
      double mag = 0.0;
      for (int64_t p = 0; p < c.K; ++p) {
        const double x = c.ta ? a[p * lda + i] : a[i * lda + p];
        const double y = c.tb ? b[j * ldb + p] : b[p * ldb + j];
        mag += std::abs(x * y);
      }
      mag = mag * std::abs(c.alpha) + (c.beta != 0.0f ? std::abs(c.beta * c0[i * ldc + j]) : 0.0);
      const double g = got[i * ldc + j], w = want[i * ldc + j];
      if (!(std::isfinite(g) && std::abs(g - w) <= tol * mag + 1e-30) && bad++ < 3)
        ADD_FAILURE() << label(c) << " at (" << i << ", " << j << "): " << g << " vs " << w;
    }
    for (int64_t j = c.N; j < ldc; ++j) {
      const float before = c0[i * ldc + j], after = got[i * ldc + j];
      if (!(before == after || (std::isnan(before) && std::isnan(after))) && bad++ < 3)
        ADD_FAILURE() << label(c) << ": padding at (" << i << ", " << j << ") changed";
    }
  }
  return bad;
}

TEST(SmallGemm, EveryTransposeAndEdgeMatchesReference) {
  const int64_t Ms[] = {1, 5, 6, 7, 13, 128};
  const int64_t Ns[] = {1, 3, 4, 7, 8, 15, 16, 17, 63, 64, 65, 130};
  const int64_t Ks[] = {0, 1, 9, 64, 129};
  const float scalars[][2] = {{1.0f, 0.0f}, {0.125f, 1.0f}, {-1.5f, 0.75f}};
  int bad = 0;
  for (int t = 0; t < 4; ++t)
    for (int64_t M : Ms)
      for (int64_t N : Ns)
        for (int64_t K : Ks)
          for (const auto& s : scalars) {
            const int64_t pad = (M + N + K) % 3 == 0 ? 0 : 5;
            bad += check({bool(t & 1), bool(t & 2), M, N, K, pad, s[0], s[1]});
          }
  EXPECT_EQ(bad, 0);
}

// The flash backward's products at their block sizes, with the row strides a (B, T, 3C) layout
// gives q, k, v.
TEST(SmallGemm, FlashBlockProductsMatchReference) {
  const int64_t d = 64, b = 128, ld = 3 * 768;
  EXPECT_EQ(check({false, false, b, b, d, ld - d, 0.125f, 0.0f}), 0);  // scores from k^T
  EXPECT_EQ(check({false, true, b, b, d, ld - d, 0.125f, 0.0f}), 0);   // scores from k
  EXPECT_EQ(check({true, false, b, d, b, 0, 1.0f, 1.0f}), 0);          // dv, dk
  EXPECT_EQ(check({false, false, b, d, b, 0, 0.125f, 1.0f}), 0);       // dq
}

// Every element is one sum over k in order, whatever tile it falls in: the rows of a product
// started one row (or one column) later are bit-identical to the same rows of the whole product.
TEST(SmallGemm, AnElementDoesNotDependOnWhereItsTileStarts) {
  const int64_t M = 29, N = 83, K = 77;
  for (int t = 0; t < 2; ++t) {
    const bool ta = t == 1;
    const int64_t lda = ta ? M : K;
    const std::vector<float> a = random_buffer((ta ? K : M) * lda, 31);
    const std::vector<float> b = random_buffer(K * N, 32);
    std::vector<float> whole(M * N), shifted(M * N, 0.0f);
    small_gemm(ta, false, M, N, K, 0.5f, a.data(), lda, b.data(), N, 0.0f, whole.data(), N,
               nullptr);
    // Rows 1.. and columns 3.. as a product of their own.
    const float* a1 = ta ? a.data() + 1 : a.data() + lda;
    small_gemm(ta, false, M - 1, N - 3, K, 0.5f, a1, lda, b.data() + 3, N, 0.0f,
               shifted.data() + N + 3, N, nullptr);
    for (int64_t i = 1; i < M; ++i)
      for (int64_t j = 3; j < N; ++j)
        ASSERT_EQ(std::memcmp(&whole[i * N + j], &shifted[i * N + j], sizeof(float)), 0)
            << (ta ? "TN" : "NN") << " at (" << i << ", " << j << "): " << whole[i * N + j]
            << " vs " << shifted[i * N + j];
  }
}

TEST(SmallGemm, TransposeIsExact) {
  for (int64_t rows : {1, 7, 8, 9, 64, 131})
    for (int64_t cols : {1, 5, 8, 16, 23, 64}) {
      const int64_t lds = cols + 3, ldd = rows + 2;
      const std::vector<float> src = random_buffer(rows * lds, 41);
      std::vector<float> dst(cols * ldd, -7.0f);
      transpose_floats(src.data(), lds, rows, cols, dst.data(), ldd);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < rows; ++r)
          ASSERT_EQ(dst[c * ldd + r], src[r * lds + c])
              << rows << "x" << cols << " (" << r << ", " << c << ")";
        for (int64_t r = rows; r < ldd; ++r) ASSERT_EQ(dst[c * ldd + r], -7.0f);
      }
    }
}

}  // namespace
}  // namespace kuai::cpu
