// dtype conversions: round-to-nearest-even, NaN, ±inf, signed zero, f16 subnormals; the f16
// conversion is checked exhaustively against F16C-equivalent arithmetic (every half value round
// trips exactly; every float between two halves rounds to the nearer, ties to even).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "kuai/core/dtype.h"

namespace kuai {
namespace {

TEST(DType, Bf16RoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808000u)), 0x3f80);
  // 1.0078125 + half ulp ties to even upward (0x3f82).
  EXPECT_EQ(float_to_bf16(bits_float(0x3f818000u)), 0x3f82);
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808001u)), 0x3f81);  // above halfway rounds up
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflows to inf
  const uint16_t nan = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(bf16_to_float(nan)));
  // A NaN whose payload sits only in the low bits must stay NaN, not become inf.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7f800001u)))));
  // Subnormal floats survive (bf16 has fp32's exponent range).
  EXPECT_EQ(bf16_to_float(float_to_bf16(bits_float(0x00010000u))), bits_float(0x00010000u));
}

TEST(DType, F16SpecialValues) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // halfway to 65536 rounds to even: inf
  EXPECT_EQ(float_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16(5.9604644775390625e-08f), 0x0001);   // smallest subnormal
  EXPECT_EQ(float_to_f16(2.98023223876953125e-08f), 0x0000);  // half of it: ties to even, 0
  EXPECT_EQ(float_to_f16(2.9802326e-08f), 0x0001);            // just above half
  EXPECT_EQ(float_to_f16(6.103515625e-05f), 0x0400);          // smallest normal
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(f16_to_float(0x7c00)));
}

TEST(DType, F16ExhaustiveRoundTripAndRounding) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(f))));
      continue;
    }
    ASSERT_EQ(float_to_f16(f), h) << "half " << h;
  }
  // Midpoints between consecutive positive finite halves round to the even neighbour.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double lo = f16_to_float(static_cast<uint16_t>(h));
    const double hi = f16_to_float(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in float
    ASSERT_EQ(float_to_f16(mid), (h % 2 == 0) ? h : h + 1) << "midpoint above " << h;
    ASSERT_EQ(float_to_f16(std::nextafter(mid, 0.0f)), h);
    ASSERT_EQ(float_to_f16(std::nextafter(mid, 1e9f)), h + 1);
  }
}

TEST(DType, BulkConvert) {
  const float src[5] = {1.5f, -2.25f, 0.0f, 1e-3f, 300.7f};
  uint16_t b[5];
  float back[5];
  convert(src, DType::kF32, b, DType::kBF16, 5);
  convert(b, DType::kBF16, back, DType::kF32, 5);
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 128);
  int32_t ints[5];
  convert(src, DType::kF32, ints, DType::kI32, 5);
  EXPECT_EQ(ints[0], 1);
  EXPECT_EQ(ints[1], -2);
  EXPECT_EQ(ints[4], 300);
}

}  // namespace
}  // namespace kuai
