// dtype conversions: round-to-nearest-even, NaN, ±inf, signed zero, f16 subnormals; the f16
// conversion is checked exhaustively against F16C-equivalent arithmetic (every half value round
// trips exactly; every float between two halves rounds to the nearer, ties to even); the bulk f16
// conversions (F16C where the CPU has it) are bit-identical to the scalar ones on every half and
// on a sweep of float patterns; convert_serial equals convert for every dtype pair.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kuai/backend/cpu/convert.h"
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

// The NaN results are those of vcvtps2ph / vcvtph2ps: sign and top payload bits kept, quiet bit
// set (a signalling NaN comes back quiet in both directions).
TEST(DType, F16NaNIsQuietedWithPayload) {
  EXPECT_EQ(float_bits(f16_to_float(0x7c01)), 0x7fc02000u);  // signalling half NaN
  EXPECT_EQ(float_bits(f16_to_float(0xfe00)), 0xffc00000u);  // quiet half NaN
  EXPECT_EQ(float_bits(f16_to_float(0x7fff)), 0x7fffe000u);
  EXPECT_EQ(float_bits(f16_to_float(0x7c00)), 0x7f800000u);  // inf stays inf
  EXPECT_EQ(float_to_f16(bits_float(0x7f800001u)), 0x7e00);  // payload only in dropped bits
  EXPECT_EQ(float_to_f16(bits_float(0xffa00000u)), 0xff00);  // signalling, payload kept
  EXPECT_EQ(float_to_f16(bits_float(0x7fc02000u)), 0x7e01);
}

// Checks the bulk conversion (and convert_serial) of `src` against the scalar function bit for
// bit, over the whole array and over an unaligned sub-range with a short tail.
void expect_bulk_f32_to_f16_matches_scalar(const std::vector<float>& src) {
  const int64_t n = static_cast<int64_t>(src.size());
  std::vector<uint16_t> bulk(src.size()), serial(src.size(), 0x1234);
  convert(src.data(), DType::kF32, bulk.data(), DType::kF16, n);
  convert_serial(src.data() + 3, DType::kF32, serial.data() + 3, DType::kF16, n - 8);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t want = float_to_f16(src[i]);
    ASSERT_EQ(bulk[i], want) << "float bits " << std::hex << float_bits(src[i]);
    if (i >= 3 && i < n - 5) {
      ASSERT_EQ(serial[i], want) << "float bits " << float_bits(src[i]);
    }
  }
}

TEST(DType, F16ToF32BulkMatchesScalarOnEveryHalf) {
  std::vector<uint16_t> halves(1 << 16);
  for (uint32_t h = 0; h < (1u << 16); ++h) halves[h] = static_cast<uint16_t>(h);
  std::vector<float> bulk(halves.size()), serial(halves.size(), 7.0f);
  convert(halves.data(), DType::kF16, bulk.data(), DType::kF32, 1 << 16);
  convert_serial(halves.data() + 1, DType::kF16, serial.data() + 1, DType::kF32, (1 << 16) - 4);
  for (uint32_t h = 0; h < (1u << 16); ++h) {
    const uint32_t want = float_bits(f16_to_float(static_cast<uint16_t>(h)));
    ASSERT_EQ(float_bits(bulk[h]), want) << "half " << std::hex << h;
    if (h >= 1 && h < (1u << 16) - 3) {
      ASSERT_EQ(float_bits(serial[h]), want) << "half " << h;
    }
  }
  // And back: every half's float converts to the same half both ways (NaNs included).
  std::vector<float> widened(bulk.begin(), bulk.end());
  expect_bulk_f32_to_f16_matches_scalar(widened);
}

TEST(DType, F32ToF16BulkMatchesScalarOnFloatSweep) {
  std::vector<float> src;
  // Every 2^10-th float pattern (2^22 of them, both signs, NaN and inf included), the low ten bits
  // scrambled so that the dropped mantissa bits vary too.
  for (uint32_t k = 0; k < (1u << 22); ++k) {
    src.push_back(bits_float((k << 10) | ((k * 2654435761u) >> 22)));
  }
  // Around every rounding boundary: each half-way point between adjacent halves (normal and
  // subnormal, both signs) and the two floats either side of it.
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double lo = f16_to_float(static_cast<uint16_t>(h));
    const double hi = h == 0x7bff ? 65536.0 : f16_to_float(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    for (float sign : {1.0f, -1.0f}) {
      for (uint32_t d = 0; d < 3; ++d) {
        src.push_back(sign * bits_float(float_bits(mid) - 1 + d));
      }
    }
  }
  // Around the largest half (65504), the overflow threshold (65520) and the subnormal range.
  for (float centre : {65504.0f, 65520.0f, 65536.0f, 6.103515625e-05f, 5.9604644775390625e-08f,
                       2.98023223876953125e-08f}) {
    for (int32_t d = -300; d <= 300; ++d) {
      const float f =
          bits_float(static_cast<uint32_t>(static_cast<int64_t>(float_bits(centre)) + d));
      src.push_back(f);
      src.push_back(-f);
    }
  }
  // Signed zeros, infinities, the largest float, float subnormals and NaNs of every kind.
  for (uint32_t u : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x00000001u,
                     0x807fffffu, 0x7f800001u, 0x7fbfffffu, 0x7fc00000u, 0xffc00001u, 0x7fffffffu,
                     0xffa5a5a5u, 0x7f802000u, 0x7f801fffu}) {
    src.push_back(bits_float(u));
  }
  expect_bulk_f32_to_f16_matches_scalar(src);
}

// convert_serial is convert without threads: identical bytes for every pair of dtypes, both over
// the whole array and when called per chunk from inside a parallel region.
TEST(DType, ConvertSerialMatchesConvert) {
  const DType types[] = {DType::kF32, DType::kBF16, DType::kF16,
                         DType::kI32, DType::kI64,  DType::kU8};
  const int64_t n = 200003;  // above convert's parallel threshold, not a multiple of the chunks
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) values[i] = static_cast<float>((i * 7919) % 25000) * 0.01f;
  for (DType st : types) {
    std::vector<uint8_t> src(static_cast<size_t>(n * dtype_size(st)));
    convert(values.data(), DType::kF32, src.data(), st, n);
    for (DType dt : types) {
      const size_t bytes = static_cast<size_t>(n * dtype_size(dt));
      std::vector<uint8_t> whole(bytes, 0xab), serial(bytes, 0xcd), chunked(bytes, 0xef);
      convert(src.data(), st, whole.data(), dt, n);
      convert_serial(src.data(), st, serial.data(), dt, n);
      const int64_t chunk = 4099;
#pragma omp parallel for num_threads(2)
      for (int64_t i = 0; i < n; i += chunk) {
        convert_serial(src.data() + i * dtype_size(st), st, chunked.data() + i * dtype_size(dt), dt,
                       std::min(chunk, n - i));
      }
      EXPECT_EQ(whole, serial) << dtype_name(st) << " -> " << dtype_name(dt);
      EXPECT_EQ(whole, chunked) << dtype_name(st) << " -> " << dtype_name(dt);
    }
  }
}

}  // namespace
}  // namespace kuai
