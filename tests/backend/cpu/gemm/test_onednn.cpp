// One cached oneDNN matmul primitive executed by every thread at once. Inside parallel regions
// (gemm_batched over the batch, attention's per-head products) all threads get the same cached
// primitive object; each execution must use its own scratchpad. In oneDNN's default library
// scratchpad mode this fails on AVX-512 CPUs, where the brgemm kernels keep packed panels in the
// primitive's one buffer (on AVX2 oneDNN 2.6 picks gemm:jit, which needs none for these shapes,
// so there the test cannot fail; the design is sound by construction: see onednn_matmul.h).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/backend/cpu/gemm/onednn.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {
namespace {

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  DType type;
};

// Operands of `type` for one thread (different values per thread, so a foreign thread's panels
// show up as wrong results), and the reference product of exactly those stored values.
struct Operands {
  std::vector<uint16_t> a16, b16;
  std::vector<float> a, b, want;
};

Operands make_operands(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Operands o;
  o.a.resize(static_cast<size_t>(c.m * c.k));
  o.b.resize(static_cast<size_t>(c.k * c.n));
  for (float& x : o.a) x = dist(rng);
  for (float& x : o.b) x = dist(rng);
  if (c.type != DType::kF32) {  // round to the stored type, so the reference sees the same values
    o.a16.resize(o.a.size());
    o.b16.resize(o.b.size());
    convert(o.a.data(), DType::kF32, o.a16.data(), c.type, static_cast<int64_t>(o.a.size()));
    convert(o.b.data(), DType::kF32, o.b16.data(), c.type, static_cast<int64_t>(o.b.size()));
    convert(o.a16.data(), c.type, o.a.data(), DType::kF32, static_cast<int64_t>(o.a.size()));
    convert(o.b16.data(), c.type, o.b.data(), DType::kF32, static_cast<int64_t>(o.b.size()));
  }
  o.want.resize(static_cast<size_t>(c.m * c.n));
  const int64_t lda = c.ta ? c.m : c.k, ldb = c.tb ? c.k : c.n;
  gemm_reference(c.ta, c.tb, c.m, c.n, c.k, 1.0f, o.a.data(), lda, o.b.data(), ldb, 0.0f,
                 o.want.data(), c.n);
  return o;
}

TEST(OneDnnMatmul, OnePrimitiveExecutedByAllThreadsAtOnceMatchesReference) {
  const Case cases[] = {
      {true, true, 9, 13, 21, DType::kF32},     {false, false, 40, 36, 52, DType::kF32},
      {false, true, 64, 64, 64, DType::kF32},   {true, false, 64, 48, 96, DType::kF32},
      {false, false, 40, 36, 52, DType::kBF16}, {false, true, 64, 64, 64, DType::kBF16},
      {true, false, 64, 48, 96, DType::kBF16},  {false, true, 33, 65, 129, DType::kF16},
  };
  const int threads = std::max(4, omp_get_max_threads());
  constexpr int kRepetitions = 50;
  for (const Case& c : cases) {
    const int64_t lda = c.ta ? c.m : c.k, ldb = c.tb ? c.k : c.n;
    OneDnnMatmulKey key{c.m,  c.n,    c.k,    lda,         ldb,  c.n,  c.ta,
                        c.tb, c.type, c.type, DType::kF32, 1.0f, 0.0f, /*threads=*/1};
    const auto mm = cached_onednn_matmul(key);
    if (!mm) {
      // oneDNN 2.6 has no bf16/f16 matmul below AVX-512 (gemm_lowp widens there instead).
      EXPECT_NE(c.type, DType::kF32) << "oneDNN must implement every fp32 matmul";
      continue;
    }
    std::vector<Operands> ops;
    for (int t = 0; t < threads; ++t) ops.push_back(make_operands(c, 100 + t));
    std::atomic<int> wrong{0};
    const double tol = 1e-5 * std::sqrt(static_cast<double>(c.k)) * c.k;
#pragma omp parallel num_threads(threads)
    {
      const Operands& o = ops[omp_get_thread_num()];
      const void* a = c.type == DType::kF32 ? static_cast<const void*>(o.a.data()) : o.a16.data();
      const void* b = c.type == DType::kF32 ? static_cast<const void*>(o.b.data()) : o.b16.data();
      std::vector<float> got(o.want.size());
      for (int r = 0; r < kRepetitions; ++r) {
        std::fill(got.begin(), got.end(), NAN);
        run_onednn_matmul(*mm, a, b, got.data());
        for (size_t i = 0; i < got.size(); ++i) {
          if (!(std::abs(got[i] - o.want[i]) <= tol)) {
            wrong.fetch_add(1);
            break;
          }
        }
      }
    }
    EXPECT_EQ(wrong.load(), 0) << "of " << threads * kRepetitions << " executions of "
                               << (c.ta ? "T" : "N") << (c.tb ? "T" : "N") << " " << c.m << "x"
                               << c.n << "x" << c.k << " " << dtype_name(c.type) << " (" << mm->impl
                               << ") gave wrong results";
  }
}

// Each thread keeps its own memory objects per primitive and points them at the operands of every
// call (run_onednn_matmul): threads alternating between primitives (one with a bias) and between
// operand buffers must get the product of exactly the buffers of that call.
TEST(OneDnnMatmul, ThreadsAlternatingPrimitivesAndBuffersGetTheirOwnOperands) {
  const Case cases[] = {{false, false, 40, 36, 52, DType::kF32},
                        {false, true, 64, 64, 64, DType::kF32},
                        {true, false, 24, 48, 96, DType::kF32}};
  constexpr int kCases = 3, kBuffers = 2, kRepetitions = 24;
  const int threads = std::max(4, omp_get_max_threads());
  std::vector<float> bias(64);
  for (size_t j = 0; j < bias.size(); ++j) bias[j] = 0.25f * static_cast<float>(j) - 3.0f;
  std::atomic<int> wrong{0};
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    std::vector<Operands> ops;  // (case, buffer)
    for (int c = 0; c < kCases; ++c)
      for (int b = 0; b < kBuffers; ++b)
        ops.push_back(make_operands(cases[c], static_cast<uint32_t>(1000 + 97 * t + 7 * c + b)));
    for (int r = 0; r < kRepetitions; ++r) {
      const int ci = r % kCases, bi = (r / kCases) % kBuffers;
      const bool with_bias = r % 2 == 1;
      const Case& c = cases[ci];
      const Operands& o = ops[static_cast<size_t>(ci * kBuffers + bi)];
      const int64_t lda = c.ta ? c.m : c.k, ldb = c.tb ? c.k : c.n;
      OneDnnMatmulKey key{c.m,  c.n,         c.k,         lda,         ldb,  c.n,  c.ta,
                          c.tb, DType::kF32, DType::kF32, DType::kF32, 1.0f, 0.0f, 1};
      key.bias = with_bias;
      const auto mm = cached_onednn_matmul(key);
      std::vector<float> got(o.want.size(), NAN);
      run_onednn_matmul(*mm, o.a.data(), o.b.data(), got.data(), with_bias ? bias.data() : nullptr);
      const double tol = 1e-5 * std::sqrt(static_cast<double>(c.k)) * c.k;
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          const double want = o.want[i * c.n + j] + (with_bias ? bias[j] : 0.0f);
          if (!(std::abs(got[i * c.n + j] - want) <= tol)) {
            wrong.fetch_add(1);
            i = c.m;
            break;
          }
        }
    }
  }
  EXPECT_EQ(wrong.load(), 0) << "of " << threads * kRepetitions << " executions gave wrong results";
}

}  // namespace
}  // namespace kuai::cpu
