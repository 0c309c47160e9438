// Tests for kuai::cpu::gemm_lowp: both paths (widen to fp32, oneDNN low-precision matmul) and the
// automatic choice, every transpose combination, odd shapes (1, 7, 33, 100) with and without
// padded leading dimensions, bf16/f16/mixed operands, f32/bf16/f16 output, against the
// double-accumulated gemm_lowp_reference; the widening path's blocking (forced in M, N and K by a
// small panel budget) and its scratch, bounded and accounted by the tracking allocator.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/backend/cpu/gemm/packed.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/core/allocator.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {
namespace {

// Tolerances. The inputs are generated exactly representable in their low dtype, so widening
// them is exact and the only errors are (1) the fp32 accumulation and (2) for a low-precision C
// the final rounding.
// (1) An fp32 dot product of length K errs by at most about K u32 sum|a_p b_p| (u32 = 2^-24),
//     typically sqrt(K) u32 sum|a_p b_p|. As in test_gemm.cpp we allow
//     e = 1e-5 sqrt(K) (|alpha| sum_p |a_p b_p| + |beta c|), ~170 u32 sqrt(K): above the worst
//     case for every K <= 28000 whatever blocking or FMA order a kernel picks, while an indexing
//     or transpose bug is off by O(1) relative and fails by orders of magnitude.
// (2) Rounding the fp32 result r to the output dtype moves it by at most half an ulp, i.e.
//     u |r| with the unit roundoff u = 2^-8 (bf16, 8 significand bits) or 2^-11 (f16, 11 bits),
//     plus, for f16, half the subnormal spacing 2^-25 near zero. With |r| <= |ref| + e the bound
//     is e + u (|ref| + e) (+ 2^-25 for f16).
constexpr double kTolPerSqrtK = 1e-5;

double unit_roundoff(DType t) {
  switch (t) {
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kF16:
      return std::ldexp(1.0, -11);
    default:
      return 0.0;
  }
}

double subnormal_half_spacing(DType t) { return t == DType::kF16 ? std::ldexp(1.0, -25) : 0.0; }

std::string dtype_label(DType t) {
  return t == DType::kF32 ? "f32" : t == DType::kBF16 ? "bf16" : "f16";
}

std::string path_label(LowpGemmPath p) {
  return p == LowpGemmPath::kAuto     ? "auto"
         : p == LowpGemmPath::kOneDNN ? "onednn"
         : p == LowpGemmPath::kPacked ? "packed"
                                      : "convert";
}

// `size` values uniform in [-1, 1), rounded to `t` and stored as `t`. `widened` receives the
// exact float value of every element.
std::vector<uint8_t> random_matrix(int64_t size, DType t, uint32_t seed,
                                   std::vector<float>* widened) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> f(static_cast<size_t>(size));
  for (float& x : f) x = dist(rng);
  std::vector<uint8_t> stored(static_cast<size_t>(size * dtype_size(t)));
  convert(f.data(), DType::kF32, stored.data(), t, size);
  widened->resize(f.size());
  convert(stored.data(), t, widened->data(), DType::kF32, size);
  return stored;
}

struct Shape {
  int64_t m, n, k;
  int64_t pad;  // extra elements on every leading dimension beyond the minimum
};

const Shape kShapes[] = {{1, 1, 1, 0},    {1, 7, 33, 0},   {7, 1, 100, 0},    {33, 100, 7, 0},
                         {100, 33, 1, 0}, {33, 7, 100, 3}, {100, 100, 33, 0}, {7, 33, 100, 5}};

struct Types {
  DType a, b;
};
const Types kOperandTypes[] = {{DType::kBF16, DType::kBF16},
                               {DType::kF16, DType::kF16},
                               {DType::kBF16, DType::kF32},
                               {DType::kF16, DType::kBF16}};
const DType kOutputTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const LowpGemmPath kPaths[] = {LowpGemmPath::kConvertFp32, LowpGemmPath::kOneDNN,
                               LowpGemmPath::kPacked, LowpGemmPath::kAuto};

class GemmLowpTest : public ::testing::Test {
 protected:
  void TearDown() override {
    set_lowp_gemm_path(LowpGemmPath::kAuto);
    set_lowp_gemm_panel_budget(0);
    set_packed_gemm_blocking({});
    set_gemm_backend(GemmBackend::kAuto);
    reset_lowp_rounds_a();
  }
};

// Runs one product through gemm_lowp and through the reference (in f32 output from the exactly
// widened initial C), and checks the bound above on every element; padding columns of C must be
// untouched.
void check(LowpGemmPath path, bool ta, bool tb, const Shape& s, Types types, DType c_type,
           float alpha, float beta) {
  const int64_t lda = (ta ? s.m : s.k) + s.pad, ldb = (tb ? s.k : s.n) + s.pad, ldc = s.n + s.pad;
  std::vector<float> a32, b32, c32;
  const auto a = random_matrix((ta ? s.k : s.m) * lda, types.a, 21, &a32);
  const auto b = random_matrix((tb ? s.n : s.k) * ldb, types.b, 22, &b32);
  auto c = random_matrix(s.m * ldc, c_type, 23, &c32);
  if (beta == 0.0f) {  // NaN garbage that beta == 0 must ignore
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(c32.begin(), c32.end(), nan);
    convert(c32.data(), DType::kF32, c.data(), c_type, s.m * ldc);
  }
  const std::vector<uint8_t> c_init = c;
  std::vector<float> want = c32;
  set_lowp_gemm_path(path);
  gemm_lowp(ta, tb, s.m, s.n, s.k, alpha, a.data(), types.a, lda, b.data(), types.b, ldb, beta,
            c.data(), c_type, ldc);
  gemm_lowp_reference(ta, tb, s.m, s.n, s.k, alpha, a.data(), types.a, lda, b.data(), types.b, ldb,
                      beta, want.data(), DType::kF32, ldc);
  std::vector<float> got(c32.size());
  convert(c.data(), c_type, got.data(), DType::kF32, s.m * ldc);

  const std::string what =
      path_label(path) + (ta ? " T" : " N") + (tb ? "T " : "N ") + dtype_label(types.a) + "x" +
      dtype_label(types.b) + "->" + dtype_label(c_type) + " " + std::to_string(s.m) + "x" +
      std::to_string(s.n) + "x" + std::to_string(s.k) + " pad " + std::to_string(s.pad) +
      " alpha " + std::to_string(alpha) + " beta " + std::to_string(beta);
  const double tol = kTolPerSqrtK * std::sqrt(static_cast<double>(std::max<int64_t>(s.k, 1)));
  const double u = unit_roundoff(c_type), tiny = subnormal_half_spacing(c_type);
  int failures = 0;
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = 0; j < s.n; ++j) {
      double magnitude = 0.0;
      for (int64_t p = 0; p < s.k; ++p) {
        const double av = ta ? a32[p * lda + i] : a32[i * lda + p];
        const double bv = tb ? b32[j * ldb + p] : b32[p * ldb + j];
        magnitude += std::abs(av * bv);
      }
      magnitude *= std::abs(alpha);
      if (beta != 0.0f) magnitude += std::abs(beta * c32[i * ldc + j]);
      const double g = got[i * ldc + j], w = want[i * ldc + j];
      const double e = tol * magnitude;
      const double bound = e + u * (std::abs(w) + e) + tiny + 1e-30;
      const bool ok = std::isfinite(g) && std::abs(g - w) <= bound;
      if (!ok && failures++ < 3) {
        ADD_FAILURE() << what << " at (" << i << "," << j << "): got " << g << " want " << w
                      << " bound " << bound;
      }
    }
    const size_t row = static_cast<size_t>(i * ldc), size = static_cast<size_t>(dtype_size(c_type));
    EXPECT_EQ(0, std::memcmp(c.data() + (row + s.n) * size, c_init.data() + (row + s.n) * size,
                             static_cast<size_t>(s.pad) * size))
        << what << ": padding of row " << i << " changed";
  }
}

TEST_F(GemmLowpTest, AllPathsTransposesShapesAndTypes) {
  const float scalars[][2] = {{1.0f, 0.0f}, {-0.75f, 1.0f}};
  for (LowpGemmPath path : kPaths) {
    for (int t = 0; t < 4; ++t) {
      for (const Shape& s : kShapes) {
        for (Types types : kOperandTypes) {
          for (DType c_type : kOutputTypes) {
            for (const auto& sc : scalars)
              check(path, t & 1, t & 2, s, types, c_type, sc[0], sc[1]);
          }
        }
      }
    }
  }
}

// A low-precision C must be exactly the round-to-nearest-even of the fp32 result, which (up to
// the accumulation order) the f32-output call produces: products of small integers are exact in
// fp32 in any order, so the two must agree bit for bit after rounding.
TEST_F(GemmLowpTest, LowPrecisionOutputIsRoundedFp32Result) {
  const int64_t M = 7, N = 33, K = 100;
  std::vector<uint16_t> a(M * K), b(K * N);
  for (int64_t i = 0; i < M * K; ++i) a[i] = float_to_bf16(static_cast<float>(i % 13 - 6));
  for (int64_t i = 0; i < K * N; ++i) b[i] = float_to_bf16(static_cast<float>(i % 11 - 5) * 0.125f);
  for (LowpGemmPath path : kPaths) {
    set_lowp_gemm_path(path);
    std::vector<float> c32(M * N);
    std::vector<uint16_t> c16(M * N);
    gemm_lowp(false, false, M, N, K, 1.1f, a.data(), DType::kBF16, K, b.data(), DType::kBF16, N,
              0.0f, c32.data(), DType::kF32, N);
    gemm_lowp(false, false, M, N, K, 1.1f, a.data(), DType::kBF16, K, b.data(), DType::kBF16, N,
              0.0f, c16.data(), DType::kBF16, N);
    for (int64_t i = 0; i < M * N; ++i) {
      ASSERT_EQ(float_to_bf16(c32[i]), c16[i]) << path_label(path) << " element " << i;
    }
  }
}

TEST_F(GemmLowpTest, BiasIsAddedBeforeTheOneRounding) {
  // gemm_lowp_bias = op(A) op(B) + bias rounded once: within the bound of `check` against the
  // double-accumulated product plus the bias, on both paths, unblocked and blocked in K.
  for (LowpGemmPath path :
       {LowpGemmPath::kConvertFp32, LowpGemmPath::kOneDNN, LowpGemmPath::kPacked})
    for (int64_t budget : {int64_t{0}, int64_t{600}})
      for (DType t : {DType::kBF16, DType::kF16})
        for (const Shape& s : {Shape{33, 100, 7, 0}, Shape{70, 90, 130, 2}}) {
          set_lowp_gemm_path(path);
          set_lowp_gemm_panel_budget(budget);
          // The packed path's budget-600 run: K slices of 50 through a 600-float accumulator.
          set_packed_gemm_blocking(budget > 0 ? PackedGemmBlocking{12, 50, 32, 600}
                                              : PackedGemmBlocking{});
          const int64_t lda = s.k + s.pad, ldb = s.k + s.pad, ldc = s.n + s.pad;
          std::vector<float> a32, b32, bias32, c32;
          const auto a = random_matrix(s.m * lda, t, 31, &a32);
          const auto b = random_matrix(s.n * ldb, t, 32, &b32);  // (N, K): the NT of linear
          const auto bias = random_matrix(s.n, t, 33, &bias32);
          auto c = random_matrix(s.m * ldc, t, 34, &c32);
          gemm_lowp_bias(false, true, s.m, s.n, s.k, a.data(), t, lda, b.data(), t, ldb,
                         bias.data(), t, c.data(), t, ldc);
          std::vector<float> want(c32.size());
          gemm_lowp_reference(false, true, s.m, s.n, s.k, 1.0f, a.data(), t, lda, b.data(), t, ldb,
                              0.0f, want.data(), DType::kF32, ldc);
          std::vector<float> got(c32.size());
          convert(c.data(), t, got.data(), DType::kF32, s.m * ldc);
          const double tol = kTolPerSqrtK * std::sqrt(static_cast<double>(s.k));
          const double u = unit_roundoff(t), tiny = subnormal_half_spacing(t);
          for (int64_t i = 0; i < s.m; ++i)
            for (int64_t j = 0; j < s.n; ++j) {
              double magnitude = std::abs(bias32[j]);
              for (int64_t p = 0; p < s.k; ++p)
                magnitude += std::abs(double(a32[i * lda + p]) * b32[j * ldb + p]);
              const double w = double(want[i * ldc + j]) + bias32[j], e = tol * magnitude;
              ASSERT_LE(std::abs(got[i * ldc + j] - w), e + u * (std::abs(w) + e) + tiny + 1e-30)
                  << path_label(path) << " budget " << budget << " " << dtype_label(t) << " at ("
                  << i << "," << j << ")";
            }
        }
}

TEST_F(GemmLowpTest, DegenerateProducts) {
  for (LowpGemmPath path : kPaths) {
    set_lowp_gemm_path(path);
    // K == 0 with beta == 0 writes zeros over NaN garbage; beta == 2 doubles C (bf16 exact).
    std::vector<uint16_t> c(6, float_to_bf16(std::numeric_limits<float>::quiet_NaN()));
    gemm_lowp(false, false, 2, 3, 0, 1.0f, nullptr, DType::kBF16, 1, nullptr, DType::kBF16, 3, 0.0f,
              c.data(), DType::kBF16, 3);
    for (uint16_t v : c) EXPECT_EQ(bf16_to_float(v), 0.0f) << path_label(path);
    std::fill(c.begin(), c.end(), float_to_bf16(1.5f));
    gemm_lowp(false, false, 2, 3, 0, 1.0f, nullptr, DType::kBF16, 1, nullptr, DType::kBF16, 3, 2.0f,
              c.data(), DType::kBF16, 3);
    for (uint16_t v : c) EXPECT_EQ(bf16_to_float(v), 3.0f) << path_label(path);
  }
}

// The widening path with a panel budget of 600 floats: op(A) (70, 130) is cut into 3 x 6 panels,
// op(B) (130, 90) into 6 x 4 and C into 3 x 4 blocks, so every product accumulates over K blocks
// (beta on the first only) and every panel is a strided view of a possibly transposed, padded
// operand. fp32 operands (read in place) and an fp32 C (accumulated in place) are covered too.
TEST_F(GemmLowpTest, BlockedWideningInAllDimensions) {
  const Types types[] = {{DType::kBF16, DType::kBF16}, {DType::kF16, DType::kF16},
                         {DType::kBF16, DType::kF32},  {DType::kF32, DType::kF16},
                         {DType::kF16, DType::kBF16},  {DType::kF32, DType::kF32}};
  const float scalars[][2] = {{1.0f, 0.0f}, {-0.75f, 1.0f}, {0.5f, -2.0f}};
  set_lowp_gemm_panel_budget(600);
  ASSERT_EQ(lowp_gemm_panel_budget(), 600);
  for (int t = 0; t < 4; ++t) {
    const int64_t pad = (t == 1 || t == 2) ? 5 : 0;  // dense and padded, both orientations
    for (Types ty : types) {
      for (DType c_type : kOutputTypes) {
        for (const auto& sc : scalars) {
          check(LowpGemmPath::kConvertFp32, t & 1, t & 2, Shape{70, 90, 130, pad}, ty, c_type,
                sc[0], sc[1]);
        }
      }
    }
  }
  // The extreme budget of one float: 1 x 1 x 1 blocks.
  set_lowp_gemm_panel_budget(1);
  for (int t = 0; t < 4; ++t) {
    for (DType c_type : kOutputTypes) {
      check(LowpGemmPath::kConvertFp32, t & 1, t & 2, Shape{5, 6, 7, 2},
            Types{DType::kBF16, DType::kF16}, c_type, -0.75f, 1.0f);
    }
  }
  set_lowp_gemm_panel_budget(0);
  EXPECT_EQ(lowp_gemm_panel_budget(), int64_t{1} << 22);
}

// The widening path's scratch comes from the tracking allocator, never exceeds three panels of
// the budget (whole widened operands would take 2.8 MB here, against 384 KiB), and is all
// returned when gemm_lowp returns. The inner fp32 products run on OpenBLAS here, whose workspace
// is its own: oneDNN's per-call scratchpad also comes from the tracking allocator and would add
// to the peak measured below.
TEST_F(GemmLowpTest, WideningScratchIsBoundedAndAccounted) {
  const int64_t M = 300, N = 500, K = 700, budget = int64_t{1} << 15;
  std::vector<float> a32, b32, c32;
  const auto a = random_matrix(K * M, DType::kBF16, 31, &a32);  // stored (K, M): transposed
  const auto b = random_matrix(N * K, DType::kF16, 32, &b32);   // stored (N, K): transposed
  auto c = random_matrix(M * N, DType::kBF16, 33, &c32);
  set_lowp_gemm_path(LowpGemmPath::kConvertFp32);
  set_lowp_gemm_panel_budget(budget);
  set_gemm_backend(GemmBackend::kOpenBLAS);
  Allocator& alloc = Allocator::get();
  alloc.empty_cache();  // fresh blocks: no larger cached block can serve a panel
  const MemoryStats before = alloc.stats();
  alloc.reset_peak();
  gemm_lowp(true, true, M, N, K, 1.0f, a.data(), DType::kBF16, M, b.data(), DType::kF16, K, 0.5f,
            c.data(), DType::kBF16, N);
  const MemoryStats after = alloc.stats();
  const int64_t panel_bytes = static_cast<int64_t>(Allocator::round_size(budget * sizeof(float)));
  const int64_t whole_bytes = (M * K + K * N + M * N) * static_cast<int64_t>(sizeof(float));
  EXPECT_GT(after.peak - before.current, 0) << "scratch not seen by the allocator";
  EXPECT_LE(after.peak - before.current, 3 * panel_bytes);
  EXPECT_LT(3 * panel_bytes, whole_bytes / 4);  // the bound is a real one
  EXPECT_EQ(after.current, before.current) << "scratch left allocated";
}

// The packed path with tiny blocks (MC 12 = two A slivers, KC 7, NC 32 = two B slivers, an
// accumulator of 500 floats): every product runs over several K slices, row blocks and column
// panels, with partial slivers at every edge (70 = 11 x 6 + 4 rows, 90 = 5 x 16 + 10 columns),
// a low-precision C goes through the bounded fp32 accumulator in row blocks (M >= N) or column
// blocks (M < N), and both orientations of both operands are packed from padded storage.
TEST_F(GemmLowpTest, PackedBlockingInAllDimensions) {
  if (!packed_gemm_available()) GTEST_SKIP() << "no AVX2/FMA/F16C";
  const Types types[] = {{DType::kBF16, DType::kBF16},
                         {DType::kF16, DType::kF16},
                         {DType::kBF16, DType::kF32},
                         {DType::kF32, DType::kF16},
                         {DType::kF32, DType::kF32}};
  const float scalars[][2] = {{1.0f, 0.0f}, {-0.75f, 1.0f}, {0.5f, -2.0f}};
  set_packed_gemm_blocking({12, 7, 32, 500});
  const PackedGemmBlocking in_force = packed_gemm_blocking();
  EXPECT_EQ(in_force.mc, 12);
  EXPECT_EQ(in_force.nc, 32);
  for (int t = 0; t < 4; ++t) {
    const int64_t pad = (t == 1 || t == 2) ? 5 : 0;
    for (Types ty : types) {
      for (DType c_type : kOutputTypes) {
        for (const auto& sc : scalars) {
          check(LowpGemmPath::kPacked, t & 1, t & 2, Shape{70, 90, 130, pad}, ty, c_type, sc[0],
                sc[1]);
          check(LowpGemmPath::kPacked, t & 1, t & 2, Shape{90, 37, 61, pad}, ty, c_type, sc[0],
                sc[1]);
        }
      }
    }
  }
  set_packed_gemm_blocking({});
  EXPECT_EQ(packed_gemm_blocking().mc % 6, 0);
}

// The packed path rounds C in registers: every fp32 value it stores as bf16 or f16 must be what
// the scalar conversions of dtype.h give, NaNs (quieted), infinities, overflow, subnormals and
// ties included. C = A (M, 1) times a row of ones, so each element of C is one element of A.
TEST_F(GemmLowpTest, PackedStoreRoundsLikeTheScalarConversions) {
  if (!packed_gemm_available()) GTEST_SKIP() << "no AVX2/FMA/F16C";
  const int64_t M = 4096, N = 16;
  std::mt19937 rng(7);
  std::vector<float> a(M);
  for (int64_t i = 0; i < M; ++i) {
    uint32_t bits = rng();
    if (i % 4 == 1) bits = (bits & 0x8000ffffu) | 0x3f800000u | ((i & 1) << 16);  // ties near 1
    if (i % 8 == 3) bits = (bits & 0x807fffffu) | 0x7f800000u;                    // inf / NaN
    if (i % 8 == 5) bits &= 0x807fffffu;                                          // subnormal
    if (i % 16 == 7) bits = (bits & 0x8000ffffu) | 0x477f0000u;  // near the f16 maximum
    a[i] = bits_float(bits);
  }
  const std::vector<float> ones(N, 1.0f);
  set_lowp_gemm_path(LowpGemmPath::kPacked);
  for (DType c_type : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> c(M * N);
    gemm_lowp(false, false, M, N, 1, 1.0f, a.data(), DType::kF32, 1, ones.data(), DType::kF32, N,
              0.0f, c.data(), c_type, N);
    for (int64_t i = 0; i < M; ++i) {
      const float v = 0.0f + a[i] * 1.0f;  // what the fp32 accumulator holds
      const uint16_t want = c_type == DType::kBF16 ? float_to_bf16(v) : float_to_f16(v);
      for (int64_t j = 0; j < N; ++j) {
        ASSERT_EQ(c[i * N + j], want)
            << dtype_label(c_type) << " row " << i << " bits 0x" << std::hex << float_bits(a[i]);
      }
    }
  }
}

// The packed path's sums are ordered by K and the slice depth only: one thread and two give the
// same bits, and its scratch comes from the tracking allocator and is all returned.
TEST_F(GemmLowpTest, PackedIsThreadCountIndependentAndAccounted) {
  if (!packed_gemm_available()) GTEST_SKIP() << "no AVX2/FMA/F16C";
  const int64_t M = 300, N = 200, K = 1100;  // two K slices at the default depth
  std::vector<float> a32, b32, c32;
  const auto a = random_matrix(M * K, DType::kBF16, 41, &a32);
  const auto b = random_matrix(N * K, DType::kBF16, 42, &b32);  // (N, K): the NT of linear
  set_lowp_gemm_path(LowpGemmPath::kPacked);
  const int threads = omp_get_max_threads();
  Allocator& alloc = Allocator::get();
  std::vector<std::vector<uint16_t>> results;
  for (int nt : {1, 2}) {
    omp_set_num_threads(nt);
    std::vector<uint16_t> c(M * N);
    const int64_t before = alloc.stats().current;
    gemm_lowp(false, true, M, N, K, 1.0f, a.data(), DType::kBF16, K, b.data(), DType::kBF16, K,
              0.0f, c.data(), DType::kBF16, N);
    EXPECT_EQ(alloc.stats().current, before) << "scratch left allocated";
    results.push_back(c);
  }
  omp_set_num_threads(threads);
  EXPECT_EQ(results[0], results[1]);
}

// Reports (not asserts) which oneDNN implementation the low-precision path gets on this CPU.
TEST_F(GemmLowpTest, ReportsOneDnnImplementation) {
  const std::string bf16 = lowp_onednn_impl(false, true, 64, 64, 64, DType::kBF16, 64, DType::kBF16,
                                            64, DType::kF32, 64);
  const std::string f16 =
      lowp_onednn_impl(false, true, 64, 64, 64, DType::kF16, 64, DType::kF16, 64, DType::kF32, 64);
  RecordProperty("onednn_bf16_impl", bf16);
  RecordProperty("onednn_f16_impl", f16);
  fmt::print("native bf16: {}; auto path: {}; oneDNN bf16 impl: '{}'; f16 impl: '{}'\n",
             cpu_has_native_bf16(), path_label(lowp_gemm_auto_path()), bf16, f16);
  EXPECT_EQ(lowp_gemm_auto_path(), isa() >= Isa::kAmx && cpu_has_native_bf16()
                                       ? LowpGemmPath::kOneDNN
                                   : packed_gemm_available() ? LowpGemmPath::kPacked
                                                             : LowpGemmPath::kConvertFp32);
}

}  // namespace
}  // namespace kuai::cpu

namespace kuai::cpu {
namespace {

// gemm_lowp_round_a: an fp32 A against a bf16 B is the product of A rounded to bf16 where the
// rounding is on (the amx tier, or forced; and then measurably not the product of the unrounded
// A), else the mixed product itself; every transpose, odd shapes, beta 0 and 1.
void check_round_a(bool rounds);

TEST_F(GemmLowpTest, RoundAIsTheProductOfTheRoundedAWhereBf16IsNative) {
  EXPECT_FALSE(lowp_rounds_a(DType::kF16));
  EXPECT_EQ(lowp_rounds_a(DType::kBF16), isa() >= Isa::kAmx && cpu_has_native_bf16());
  for (int forced : {-1, 0, 1}) {  // the tier's choice, then off and on whatever the CPU
    if (forced >= 0) set_lowp_rounds_a(forced == 1);
    check_round_a(lowp_rounds_a(DType::kBF16));
  }
  reset_lowp_rounds_a();
}

void check_round_a(bool rounds) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (const Shape& s : {Shape{33, 17, 70, 0}, Shape{64, 64, 64, 3}, Shape{7, 40, 129, 1}}) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const int64_t lda = (ta ? s.m : s.k) + s.pad, ldb = (tb ? s.k : s.n) + s.pad, ldc = s.n;
      std::vector<float> a(static_cast<size_t>((ta ? s.k : s.m) * lda)), b32;
      for (float& x : a) x = dist(rng);  // fp32 values, mostly not bf16 ones
      std::vector<float> a_rounded(a.size());
      std::vector<uint16_t> tmp(a.size());
      convert(a.data(), DType::kF32, tmp.data(), DType::kBF16, static_cast<int64_t>(a.size()));
      convert(tmp.data(), DType::kBF16, a_rounded.data(), DType::kF32,
              static_cast<int64_t>(a.size()));
      const auto b = random_matrix((tb ? s.n : s.k) * ldb, DType::kBF16, 7, &b32);
      for (float beta : {0.0f, 1.0f}) {
        std::vector<float> got(static_cast<size_t>(s.m * ldc), 0.25f);
        std::vector<float> want_rounded = got, want_plain = got;
        gemm_lowp_round_a(ta, tb, s.m, s.n, s.k, 1.0f, a.data(), lda, b.data(), DType::kBF16, ldb,
                          beta, got.data(), DType::kF32, ldc);
        gemm_lowp_reference(ta, tb, s.m, s.n, s.k, 1.0f, a_rounded.data(), DType::kF32, lda,
                            b.data(), DType::kBF16, ldb, beta, want_rounded.data(), DType::kF32,
                            ldc);
        gemm_lowp_reference(ta, tb, s.m, s.n, s.k, 1.0f, a.data(), DType::kF32, lda, b.data(),
                            DType::kBF16, ldb, beta, want_plain.data(), DType::kF32, ldc);
        const std::vector<float>& want = rounds ? want_rounded : want_plain;
        // |a b| <= 1 per term: the magnitude bound of check() is at most K (+ |beta c|).
        const double tol = kTolPerSqrtK * std::sqrt(static_cast<double>(s.k)) * (s.k + 1);
        double off_plain = 0.0;
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_LE(std::abs(got[i] - want[i]), tol)
              << (ta ? "T" : "N") << (tb ? "T" : "N") << " " << s.m << "x" << s.n << "x" << s.k
              << " beta " << beta << " element " << i << (rounds ? " (A rounded)" : "");
          off_plain = std::max(off_plain, static_cast<double>(std::abs(got[i] - want_plain[i])));
        }
        if (rounds) {
          EXPECT_GT(off_plain, tol) << "A was not rounded to bf16";
        }
      }
    }
  }
}

}  // namespace
}  // namespace kuai::cpu
