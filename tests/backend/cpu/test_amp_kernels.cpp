// Tests of the loss-scale unscaling kernel (unscale_and_check) against its naive reference: the
// product is bit-for-bit the reference's, the flag is raised for inf, -inf and NaN wherever they
// sit (first, middle, last element; vector tails and several parallel chunks), raised by an
// overflowing product too, and left untouched when everything is finite.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu {
namespace {

const std::vector<int64_t> kSizes = {1, 7, 8, 1000003};
constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

using kuai::test::uniform;

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// Every element bit for bit (NaN payloads included: the multiply keeps them on both paths).
void expect_bitwise_equal(const std::vector<float>& got, const std::vector<float>& want,
                          const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i)
    if (bits(got[i]) != bits(want[i])) {
      ++failures;
      ADD_FAILURE() << what << " n=" << got.size() << " i=" << i << " got " << got[i] << " want "
                    << want[i];
    }
}

// Runs the kernel and the reference on copies of g; returns both flags (starting at `flag0`).
std::pair<float, float> run_both(std::vector<float> g, float inv_scale, float flag0,
                                 const char* what) {
  auto g_ref = g;
  float flag = flag0, flag_ref = flag0;
  unscale_and_check(g.data(), static_cast<int64_t>(g.size()), inv_scale, &flag);
  ref::unscale_and_check(g_ref.data(), static_cast<int64_t>(g_ref.size()), inv_scale, &flag_ref);
  expect_bitwise_equal(g, g_ref, what);
  return {flag, flag_ref};
}

// Finite gradients: the product equals the reference bit for bit and the flag is not touched
// (a sentinel value survives). Powers of two and an inexact 1/3 both.
TEST(GradScalerKernel, FiniteMatchesReferenceAndLeavesFlag) {
  for (int64_t n : kSizes)
    for (float inv_scale : {1.0f / 65536.0f, 1.0f, 1.0f / 3.0f, 8.0f}) {
      const auto g = uniform(n, -3.0e4f, 3.0e4f, 7);
      const auto [flag, flag_ref] = run_both(g, inv_scale, 0.5f, "finite");
      EXPECT_EQ(flag, 0.5f) << "n=" << n << " inv_scale=" << inv_scale;
      EXPECT_EQ(flag_ref, 0.5f);
    }
  // Exponent fields 0x7f (1.5) and 0x80 (3.0) OR to all ones: the test must not combine them so.
  const auto [flag, flag_ref] = run_both({1.5f, -1.5f}, 2.0f, 0.5f, "exponent pair");
  EXPECT_EQ(flag, 0.5f);
  EXPECT_EQ(flag_ref, 0.5f);
}

// With a power-of-two inv_scale the product is exact: g * 2^-16 is g with its exponent lowered.
TEST(GradScalerKernel, PowerOfTwoUnscaleIsExact) {
  const int64_t n = 1000003;
  const auto g = uniform(n, -1.0f, 1.0f, 11);
  std::vector<float> scaled(n);
  for (int64_t i = 0; i < n; ++i) scaled[i] = g[i] * 65536.0f;
  float flag = 0.0f;
  unscale_and_check(scaled.data(), n, 1.0f / 65536.0f, &flag);
  expect_bitwise_equal(scaled, g, "exact unscale");
  EXPECT_EQ(flag, 0.0f);
}

// inf, -inf and NaN at the first, middle and last position (and in the last, partial vector of
// the chunk for the odd sizes): the flag is 1, the other elements are still unscaled.
TEST(GradScalerKernel, NonFiniteSetsFlagAnywhere) {
  for (int64_t n : kSizes)
    for (float bad : {kInf, -kInf, kNaN})
      for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
        auto g = uniform(n, -1.0f, 1.0f, 13);
        g[pos] = bad;
        const auto [flag, flag_ref] = run_both(g, 1.0f / 1024.0f, 0.0f, "non-finite");
        EXPECT_EQ(flag, 1.0f) << "n=" << n << " bad=" << bad << " pos=" << pos;
        EXPECT_EQ(flag_ref, 1.0f);
      }
}

// A finite gradient whose product overflows (inv_scale > 1, i.e. a scale below 1) is caught.
TEST(GradScalerKernel, OverflowingProductSetsFlag) {
  for (int64_t n : kSizes) {
    auto g = uniform(n, -1.0f, 1.0f, 17);
    g[n - 1] = 3.0e38f;
    const auto [flag, flag_ref] = run_both(g, 4.0f, 0.0f, "overflow");
    EXPECT_EQ(flag, 1.0f) << "n=" << n;
    EXPECT_EQ(flag_ref, 1.0f);
  }
}

// One flag accumulates over several tensors: a later clean tensor does not clear it.
TEST(GradScalerKernel, FlagAccumulatesOverTensors) {
  auto a = uniform(100, -1.0f, 1.0f, 19), b = uniform(1000003, -1.0f, 1.0f, 23);
  a[42] = kNaN;
  float flag = 0.0f;
  unscale_and_check(a.data(), 100, 0.5f, &flag);
  unscale_and_check(b.data(), 1000003, 0.5f, &flag);
  EXPECT_EQ(flag, 1.0f);
  unscale_and_check(b.data(), 0, 0.5f, &flag);  // n = 0: nothing happens
  EXPECT_EQ(flag, 1.0f);
}

}  // namespace
}  // namespace kuai::cpu
