// Tests of the embedding kernels against the reference: the forward is an exact row gather; the
// backward's scatter-add must handle repeated ids, overwrite all of dW, reject bad ids, and be
// bit-identical whatever the thread count.
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

constexpr double kUlp = FLT_EPSILON;  // 2^-23

using kuai::test::uniform;

std::vector<int32_t> ids(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(gen);
  return v;
}

TEST(EmbeddingForward, GathersRowsExactly) {
  const int64_t shapes[][3] = {{1, 1, 1}, {3, 17, 5}, {5, 33, 4}, {64, 768, 50}, {1024, 40, 5000}};
  uint32_t seed = 1;
  for (auto [N, C, V] : shapes) {
    SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C << " V=" << V);
    auto W = uniform(V * C, -1.0f, 1.0f, seed++);  // (V, C)
    auto idx = ids(N, V, seed++);
    std::vector<float> out(N * C), out_ref(N * C);
    kuai::cpu::embedding_forward(W.data(), idx.data(), out.data(), N, C);
    kuai::cpu::ref::embedding_forward(W.data(), idx.data(), out_ref.data(), N, C);
    EXPECT_EQ(out, out_ref);  // a copy: bit-exact
  }
}

void check_backward(int64_t N, int64_t C, int64_t V, const std::vector<int32_t>& idx,
                    uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "N=" << N << " C=" << C << " V=" << V);
  auto dout = uniform(N * C, -1.0f, 1.0f, seed);     // (N, C)
  std::vector<float> dW(V * C, NAN), dW_ref(V * C);  // NaN: every element must be overwritten
  kuai::cpu::embedding_backward(dout.data(), idx.data(), dW.data(), N, C, V);
  kuai::cpu::ref::embedding_backward(dout.data(), idx.data(), dW_ref.data(), N, C, V);
  std::vector<int64_t> uses(V, 0);
  std::vector<double> abs_sum(V * C, 0.0);  // (V, C): sum of |dout| scattered to each element
  for (int64_t i = 0; i < N; ++i) {
    ++uses[idx[i]];
    for (int64_t c = 0; c < C; ++c) abs_sum[idx[i] * C + c] += std::fabs(dout[i * C + c]);
  }
  for (int64_t v = 0; v < V; ++v)
    for (int64_t c = 0; c < C; ++c) {
      // A float sum of k terms (k = uses of the id) has error at most (k - 1) eps sum |term|; the
      // reference rounds once more. Ids used once or never must match exactly.
      const double tol =
          uses[v] > 1 ? static_cast<double>(uses[v]) * kUlp * abs_sum[v * C + c] : 0.0;
      ASSERT_NEAR(dW[v * C + c], dW_ref[v * C + c], tol) << "id " << v << " col " << c;
    }
}

TEST(EmbeddingBackward, MatchesReferenceWithRepeatedIds) {
  const int64_t shapes[][3] = {{1, 1, 1},     {3, 17, 5},       {5, 33, 4},
                               {64, 768, 50}, {1024, 40, 5000}, {300, 129, 7}};
  uint32_t seed = 20;
  for (auto [N, C, V] : shapes) check_backward(N, C, V, ids(N, V, seed + 1), seed), seed += 2;
}

TEST(EmbeddingBackward, AllRowsOneId) {
  const int64_t N = 200, C = 33, V = 9;
  check_backward(N, C, V, std::vector<int32_t>(N, 4), 40);
  check_backward(N, C, V, std::vector<int32_t>(N, 0), 41);
  check_backward(N, C, V, std::vector<int32_t>(N, V - 1), 42);
}

TEST(EmbeddingBackward, NoRows) {
  const int64_t C = 5, V = 3;
  std::vector<float> dW(V * C, 7.0f);
  kuai::cpu::embedding_backward(nullptr, nullptr, dW.data(), 0, C, V);
  for (float g : dW) EXPECT_EQ(g, 0.0f);
}

TEST(EmbeddingBackward, IdOutOfRangeThrows) {
  const int64_t N = 4, C = 3, V = 6;
  auto dout = uniform(N * C, -1.0f, 1.0f, 50);
  std::vector<float> dW(V * C);
  for (int32_t bad : {6, -1}) {
    const std::vector<int32_t> idx = {0, 5, 3, bad};
    try {
      kuai::cpu::embedding_backward(dout.data(), idx.data(), dW.data(), N, C, V);
      ADD_FAILURE() << "no throw for id " << bad;
    } catch (const std::out_of_range& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("row 3"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
    }
  }
}

TEST(EmbeddingBackward, BitIdenticalAcrossThreadCounts) {
  const int64_t N = 2000, C = 96, V = 700;  // many repeats, above the parallel threshold
  auto dout = uniform(N * C, -1.0f, 1.0f, 60);
  auto idx = ids(N, V, 61);
  std::vector<float> dW1(V * C), dW2(V * C);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  kuai::cpu::embedding_backward(dout.data(), idx.data(), dW1.data(), N, C, V);
  omp_set_num_threads(2);
  kuai::cpu::embedding_backward(dout.data(), idx.data(), dW2.data(), N, C, V);
  omp_set_num_threads(saved);
  EXPECT_EQ(dW1, dW2);
}

}  // namespace
