// Tensor handles and views, the allocator's accounting, and the Philox generator.
#include <gtest/gtest.h>
#include <omp.h>

#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"

namespace kuai {
namespace {

TEST(Tensor, ViewsShareStorage) {
  Tensor x = from_vector({0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor t = transpose(x, 0, 1);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.storage(), x.storage());
  EXPECT_EQ(t.contiguous().to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  Tensor r = reshape(x, {3, 2});
  EXPECT_EQ(r.storage(), x.storage());  // contiguous: a view
  Tensor rt = reshape(t, {6});          // not viewable: a copy
  EXPECT_NE(rt.storage(), x.storage());
  EXPECT_EQ(rt.to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  auto parts = chunk(x, 3, 1);
  EXPECT_EQ(parts[2].to_vector<float>(), (std::vector<float>{2, 5}));
  // Splitting the unit-stride dim of a column slice is still a view.
  Tensor v = reshape(chunk(from_vector(std::vector<float>(24, 1.0f), {2, 12}), 3, 1)[1], {2, 2, 2});
  EXPECT_EQ(v.strides(), (Shape{12, 2, 1}));
}

TEST(Tensor, ItemAndErrors) {
  EXPECT_FLOAT_EQ(full({1}, 2.5f).item(), 2.5f);
  EXPECT_THROW(full({2}, 1.0f).item(), std::invalid_argument);
  EXPECT_THROW(Tensor::empty({-1}), std::invalid_argument);
}

TEST(Allocator, TracksCurrentAndPeakAndReusesBlocks) {
  Allocator& a = Allocator::get();
  const MemoryStats s0 = a.stats();
  a.reset_peak();
  {
    Tensor t = Tensor::empty({1 << 20});  // 4 MiB
    EXPECT_EQ(a.stats().current - s0.current, 4 << 20);
    {
      Tensor u = Tensor::empty({1 << 18});  // 1 MiB
      EXPECT_EQ(a.stats().peak - s0.current, 5 << 20);
    }
    EXPECT_EQ(a.stats().current - s0.current, 4 << 20);
  }
  EXPECT_EQ(a.stats().current, s0.current);
  const int64_t hits = a.stats().cache_hits;
  Tensor again = Tensor::empty({1 << 20});
  EXPECT_EQ(a.stats().cache_hits, hits + 1);  // served from the cache
  a.reset_peak();
  EXPECT_EQ(a.stats().peak, a.stats().current);
}

TEST(Rng, PhiloxKnownAnswer) {
  // Random123's published vector for Philox4x32-10 with counter 0 and key 0.
  auto r = philox4x32(0, 0, 0);
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
}

TEST(Rng, IndependentOfThreadCount) {
  const int prev = omp_get_max_threads();
  omp_set_num_threads(1);
  Generator g1(42, 5);
  Tensor a = g1.normal({1 << 18});
  Tensor ai = g1.randint({1 << 17}, 0, 50257);
  omp_set_num_threads(2);
  Generator g2(42, 5);
  Tensor b = g2.normal({1 << 18});
  Tensor bi = g2.randint({1 << 17}, 0, 50257);
  omp_set_num_threads(prev);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
  EXPECT_EQ(ai.to_vector<int32_t>(), bi.to_vector<int32_t>());
  // Moments of the normal draw.
  double m = 0, v = 0;
  for (float x : a.to_vector<float>()) m += x;
  m /= a.numel();
  for (float x : a.to_vector<float>()) v += (x - m) * (x - m);
  v /= a.numel();
  EXPECT_NEAR(m, 0.0, 0.01);
  EXPECT_NEAR(v, 1.0, 0.01);
  // Different streams differ.
  Generator g3(42, 6);
  EXPECT_NE(g3.normal({8}).to_vector<float>(), Generator(42, 5).normal({8}).to_vector<float>());
}

}  // namespace
}  // namespace kuai
