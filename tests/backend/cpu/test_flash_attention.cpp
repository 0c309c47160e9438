// Tests of the CPU flash-attention kernels against a float64 naive reference: odd shapes (T = 1,
// T not a multiple of the blocks and across them, head_dim 16, 33, 64, 128), causal and not,
// several heads with strided rows (q, k, v as column slices of one fused buffer, as the model lays
// them out), fp32, bf16 and f16, fewer queries than keys (a KV cache). Acceptance is
// FlashAttention's own rule: the error of the output and of dq, dk, dv against the float64
// reference is at most twice that of kuai's naive kernels (attention.h) on the same inputs, plus
// 1e-6 where both are near exact. lse is checked against the reference log-sum-exp. The backward
// is the same bit for bit whatever the thread count; the work space is O(d) per thread: the
// allocator sees no T x T buffer.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/attention.h"
#include "kuai/backend/cpu/flash_attention.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/core/allocator.h"
#include "kuai/core/dtype.h"

namespace kuai::cpu {
namespace {

struct Shape {
  int64_t heads, T, d;
};

// q, k, v of every head in one (T, heads, 3, d) buffer: row stride 3 * heads * d.
struct Problem {
  int64_t heads, T, d, ld;
  std::vector<float> qkv;
  const float* q(int64_t h) const { return qkv.data() + h * 3 * d; }
  const float* k(int64_t h) const { return q(h) + d; }
  const float* v(int64_t h) const { return q(h) + 2 * d; }
};

Problem make(const Shape& s, uint32_t seed) {
  Problem p{s.heads, s.T, s.d, 3 * s.heads * s.d, {}};
  p.qkv = kuai::test::uniform(s.T * p.ld, -2.0f, 2.0f, seed);
  return p;
}

// Row i of one head's attention probabilities in float64: row[0, n) for the n keys it sees;
// returns the row's log-sum-exp of the scaled scores.
double reference_row(const Problem& p, int64_t h, int64_t i, float scale, int64_t n, double* row) {
  double mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    double dot = 0.0;
    for (int64_t c = 0; c < p.d; ++c)
      dot += static_cast<double>(p.q(h)[i * p.ld + c]) * p.k(h)[j * p.ld + c];
    row[j] = static_cast<double>(scale) * dot;
    mx = std::max(mx, row[j]);
  }
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - mx));
  for (int64_t j = 0; j < n; ++j) row[j] /= sum;
  return mx + std::log(sum);
}

// Reference for one head in float64: y (T, d) and lse (T).
void reference(const Problem& p, int64_t h, float scale, bool causal, std::vector<double>* y,
               std::vector<double>* lse) {
  const int64_t T = p.T, d = p.d;
  y->assign(static_cast<size_t>(T * d), 0.0);
  lse->assign(static_cast<size_t>(T), 0.0);
  std::vector<double> w(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) {
    const int64_t n = causal ? i + 1 : T;
    (*lse)[i] = reference_row(p, h, i, scale, n, w.data());
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < d; ++c) (*y)[i * d + c] += w[j] * p.v(h)[j * p.ld + c];
  }
}

TEST(FlashAttention, ForwardMatchesFloat64WithinTwiceTheNaiveKernelsError) {
  const Shape shapes[] = {{1, 1, 16},   {2, 7, 33},   {3, 64, 64},  {2, 65, 64},
                          {1, 130, 16}, {2, 200, 33}, {1, 257, 64}, {1, 150, 128}};
  for (const Shape& sh : shapes) {
    for (bool causal : {true, false}) {
      const Problem p = make(sh, static_cast<uint32_t>(sh.T * 7 + sh.d));
      const float scale = 1.0f / std::sqrt(static_cast<float>(sh.d));
      const int64_t T = sh.T, d = sh.d;
      std::vector<float> o(static_cast<size_t>(sh.heads * T * d), NAN);
      std::vector<float> lse(static_cast<size_t>(sh.heads * T), NAN);
      std::vector<FlashHead> heads;
      for (int64_t h = 0; h < sh.heads; ++h) {
        heads.push_back({p.q(h), p.k(h), p.v(h), o.data() + h * T * d, lse.data() + h * T, p.ld,
                         p.ld, p.ld, d});
      }
      flash_attention_forward(heads, FlashParams{T, T, d, scale, causal});
      for (int64_t h = 0; h < sh.heads; ++h) {
        std::vector<double> y_ref, lse_ref;
        reference(p, h, scale, causal, &y_ref, &lse_ref);
        // kuai's fp32 naive kernel on the same head.
        std::vector<float> pr(static_cast<size_t>(T * T)), y_naive(static_cast<size_t>(T * d)),
            s(static_cast<size_t>(T * T));
        attention_head_forward(HeadView{p.q(h), p.k(h), p.v(h), p.ld, p.ld, p.ld}, pr.data(),
                               y_naive.data(), d, T, d, scale, causal, s.data());
        double err_flash = 0.0, err_naive = 0.0;
        for (int64_t i = 0; i < T * d; ++i) {
          err_flash = std::max(err_flash, std::abs(o[h * T * d + i] - y_ref[i]));
          err_naive = std::max(err_naive, std::abs(y_naive[i] - y_ref[i]));
        }
        EXPECT_LE(err_flash, 2.0 * err_naive + 1e-6)
            << "heads " << sh.heads << " T " << T << " d " << d << " causal " << causal << " head "
            << h << ": naive error " << err_naive;
        for (int64_t i = 0; i < T; ++i) {
          EXPECT_NEAR(lse[h * T + i], lse_ref[i], 1e-5 * (1.0 + std::abs(lse_ref[i])))
              << "lse row " << i << " T " << T << " d " << d << " causal " << causal;
        }
      }
    }
  }
}

// float64 gradients of one head for the output gradient g (T, d): dq, dk, dv (T, d) each.
void reference_backward(const Problem& p, int64_t h, const std::vector<float>& g, float scale,
                        bool causal, std::vector<double>* dq, std::vector<double>* dk,
                        std::vector<double>* dv) {
  const int64_t T = p.T, d = p.d;
  for (auto* x : {dq, dk, dv}) x->assign(static_cast<size_t>(T * d), 0.0);
  std::vector<double> P(static_cast<size_t>(T * T), 0.0), dP(static_cast<size_t>(T * T), 0.0);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t n = causal ? i + 1 : T;
    reference_row(p, h, i, scale, n, P.data() + i * T);
    double rowdot = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0.0;
      for (int64_t c = 0; c < d; ++c)
        dot += static_cast<double>(g[i * d + c]) * p.v(h)[j * p.ld + c];
      dP[i * T + j] = dot;
      rowdot += dot * P[i * T + j];
    }
    for (int64_t j = 0; j < n; ++j) {
      const double ds = P[i * T + j] * (dP[i * T + j] - rowdot) * scale;
      for (int64_t c = 0; c < d; ++c) {
        (*dv)[j * d + c] += P[i * T + j] * g[i * d + c];
        (*dq)[i * d + c] += ds * p.k(h)[j * p.ld + c];
        (*dk)[j * d + c] += ds * p.q(h)[i * p.ld + c];
      }
    }
  }
}

double max_error(const float* got, int64_t ld, const std::vector<double>& want, int64_t T,
                 int64_t d) {
  double e = 0.0;
  for (int64_t i = 0; i < T; ++i)
    for (int64_t c = 0; c < d; ++c) e = std::max(e, std::abs(got[i * ld + c] - want[i * d + c]));
  return e;
}

// Both kernels for the block products: the libraries' and the small GEMM (flash_attention.h).
constexpr BlockProducts kProducts[] = {BlockProducts::kLibrary, BlockProducts::kSmall};

TEST(FlashAttention, BackwardMatchesFloat64WithinTwiceTheNaiveKernelsError) {
  const Shape shapes[] = {{1, 1, 16},   {2, 7, 33},    {2, 65, 64}, {1, 130, 16},
                          {2, 200, 33}, {1, 150, 128}, {4, 257, 64}};
  for (const Shape& sh : shapes) {
    for (auto [causal, products] :
         {std::pair{true, kProducts[0]}, std::pair{true, kProducts[1]},
          std::pair{false, kProducts[0]}, std::pair{false, kProducts[1]}}) {
      const Problem p = make(sh, static_cast<uint32_t>(sh.T * 11 + sh.d));
      const float scale = 1.0f / std::sqrt(static_cast<float>(sh.d));
      const int64_t T = sh.T, d = sh.d, H = sh.heads;
      const std::vector<float> g = kuai::test::uniform(H * T * d, -1.0f, 1.0f, 99);
      std::vector<float> o(static_cast<size_t>(H * T * d)), lse(static_cast<size_t>(H * T));
      std::vector<float> dqkv(static_cast<size_t>(H * T * 3 * d), NAN);  // (H, T, 3, d)
      std::vector<FlashHead> fwd;
      std::vector<FlashHeadGrad> bwd;
      for (int64_t h = 0; h < H; ++h) {
        fwd.push_back({p.q(h), p.k(h), p.v(h), o.data() + h * T * d, lse.data() + h * T, p.ld, p.ld,
                       p.ld, d});
        float* dq = dqkv.data() + h * T * 3 * d;
        bwd.push_back({p.q(h), p.k(h), p.v(h), o.data() + h * T * d, g.data() + h * T * d,
                       lse.data() + h * T, dq, dq + d, dq + 2 * d, p.ld, p.ld, p.ld, d, d, 3 * d,
                       3 * d, 3 * d});
      }
      flash_attention_forward(fwd, FlashParams{T, T, d, scale, causal});
      flash_attention_backward(bwd, FlashParams{T, T, d, scale, causal}, products);
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<float> gh(g.begin() + h * T * d, g.begin() + (h + 1) * T * d);
        std::vector<double> dq_ref, dk_ref, dv_ref;
        reference_backward(p, h, gh, scale, causal, &dq_ref, &dk_ref, &dv_ref);
        // kuai's fp32 naive kernels on the same head.
        std::vector<float> pr(static_cast<size_t>(T * T)), y(static_cast<size_t>(T * d)),
            s(static_cast<size_t>(T * T)), naive(static_cast<size_t>(3 * T * d));
        const HeadView hv{p.q(h), p.k(h), p.v(h), p.ld, p.ld, p.ld};
        attention_head_forward(hv, pr.data(), y.data(), d, T, d, scale, causal, s.data());
        attention_head_backward(hv, pr.data(), gh.data(), d, naive.data(), d, naive.data() + T * d,
                                d, naive.data() + 2 * T * d, d, T, d, scale, causal, s.data());
        const float* flash = dqkv.data() + h * T * 3 * d;
        const std::vector<double>* refs[] = {&dq_ref, &dk_ref, &dv_ref};
        const char* names[] = {"dq", "dk", "dv"};
        for (int x = 0; x < 3; ++x) {
          const double e_flash = max_error(flash + x * d, 3 * d, *refs[x], T, d);
          const double e_naive = max_error(naive.data() + x * T * d, d, *refs[x], T, d);
          EXPECT_LE(e_flash, 2.0 * e_naive + 1e-6)
              << names[x] << " heads " << H << " T " << T << " d " << d << " causal " << causal
              << " head " << h << " products " << block_products_name(products) << ": naive error "
              << e_naive;
        }
      }
    }
  }
}

// The naive kernels with their products on the small GEMM (k^T, v^T in `bt`): output, dq, dk, dv
// against the float64 reference within twice the error of the same kernels on the libraries, plus
// 1e-6 (the flash rule); T across the 64-row blocks and below head_dim (bt is d x T), strided rows.
TEST(NaiveAttention, SmallGemmProductsMatchFloat64WithinTwiceTheLibraryError) {
  const Shape shapes[] = {{1, 1, 16}, {2, 7, 33}, {1, 130, 16}, {2, 200, 64}, {1, 70, 128}};
  for (const Shape& sh : shapes) {
    for (bool causal : {true, false}) {
      const Problem p = make(sh, static_cast<uint32_t>(sh.T * 13 + sh.d));
      const float scale = 1.0f / std::sqrt(static_cast<float>(sh.d));
      const int64_t T = sh.T, d = sh.d;
      const std::vector<float> g = kuai::test::uniform(sh.heads * T * d, -1.0f, 1.0f, 98);
      for (int64_t h = 0; h < sh.heads; ++h) {
        const std::vector<float> gh(g.begin() + h * T * d, g.begin() + (h + 1) * T * d);
        std::vector<double> y_ref, lse_ref, dq_ref, dk_ref, dv_ref;
        reference(p, h, scale, causal, &y_ref, &lse_ref);
        reference_backward(p, h, gh, scale, causal, &dq_ref, &dk_ref, &dv_ref);
        const HeadView hv{p.q(h), p.k(h), p.v(h), p.ld, p.ld, p.ld};
        // [0, T d): y; then dq, dk, dv.
        auto run = [&](bool small) {
          std::vector<float> pr(T * T), s(T * T), bt(d * T, NAN), out(4 * T * d, NAN);
          float* b = small ? bt.data() : nullptr;
          attention_head_forward(hv, pr.data(), out.data(), d, T, d, scale, causal, s.data(), b);
          attention_head_backward(hv, pr.data(), gh.data(), d, out.data() + T * d, d,
                                  out.data() + 2 * T * d, d, out.data() + 3 * T * d, d, T, d, scale,
                                  causal, s.data(), b);
          return out;
        };
        const std::vector<float> lib = run(false), small = run(true);
        const std::vector<double>* refs[] = {&y_ref, &dq_ref, &dk_ref, &dv_ref};
        const char* names[] = {"y", "dq", "dk", "dv"};
        for (int x = 0; x < 4; ++x) {
          const double e_small = max_error(small.data() + x * T * d, d, *refs[x], T, d);
          const double e_lib = max_error(lib.data() + x * T * d, d, *refs[x], T, d);
          EXPECT_LE(e_small, 2.0 * e_lib + 1e-6)
              << names[x] << " T " << T << " d " << d << " causal " << causal << " head " << h
              << ": library error " << e_lib;
        }
      }
    }
  }
}

// The tuning cache's entry `key` names `got` and holds both measured times, and `got` is the
// faster of them (swapping the choice's comparison fails this). The entry's times are rounded to
// the microsecond: equal there, either may have been faster.
void expect_recorded_as_the_faster(const std::string& key, BlockProducts got) {
  TuningCache& cache = TuningCache::get();
  const std::optional<std::string> recorded = cache.find(key);
  ASSERT_TRUE(recorded.has_value()) << key;
  EXPECT_EQ(*recorded, block_products_name(got));
  std::string measured;
  for (const TuningEntry& e : cache.entries())
    if (e.key == key) measured = e.measured;
  double library_ms = 0, small_ms = 0;
  ASSERT_EQ(std::sscanf(measured.c_str(), "library %lf small %lf ms", &library_ms, &small_ms), 2)
      << measured;
  EXPECT_GT(library_ms, 0.0);
  EXPECT_GT(small_ms, 0.0);
  if (small_ms != library_ms) {
    EXPECT_EQ(got, small_ms < library_ms ? BlockProducts::kSmall : BlockProducts::kLibrary)
        << measured;
  }
}

// A choice holds for the T of its bucket: the power of two at or above T, within the bounds.
TEST(NaiveAttention, ProductChoicesAreBucketedByT) {
  EXPECT_EQ(block_products_bucket(1, 64, 2048), 64);
  EXPECT_EQ(block_products_bucket(64, 64, 2048), 64);
  EXPECT_EQ(block_products_bucket(65, 64, 2048), 128);
  EXPECT_EQ(block_products_bucket(1000, 64, 2048), 1024);
  EXPECT_EQ(block_products_bucket(1024, 128, 4096), 1024);
  EXPECT_EQ(block_products_bucket(9000, 128, 4096), 4096);
}

// The naive kernels' products by measurement, as the flash backward's (below): recorded with both
// times, the faster of the two, standing when asked again.
TEST(NaiveAttention, TheProductsAreTheFasterMeasured) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  const BlockProducts got = naive_attention_products(100, 24);
  expect_recorded_as_the_faster(fmt::format("naive products d24 T128 t{}", omp_get_max_threads()),
                                got);
  EXPECT_EQ(naive_attention_products(100, 24), got);
  set_block_products(BlockProducts::kSmall);
  EXPECT_EQ(naive_attention_products(100, 24), BlockProducts::kSmall);
  set_block_products(BlockProducts::kAuto);
}

// The forward's only scratch is the per-thread work space: at T = 1024 one T x T fp32 matrix is
// 4 MiB, the allocator's peak rises by well under a tenth of that.
TEST(FlashAttention, WorkSpaceIsIndependentOfT) {
  const Shape sh{2, 1024, 64};
  const Problem p = make(sh, 5);
  std::vector<float> o(static_cast<size_t>(sh.heads * sh.T * sh.d)), lse(sh.heads * sh.T);
  std::vector<FlashHead> heads;
  for (int64_t h = 0; h < sh.heads; ++h) {
    heads.push_back({p.q(h), p.k(h), p.v(h), o.data() + h * sh.T * sh.d, lse.data() + h * sh.T,
                     p.ld, p.ld, p.ld, sh.d});
  }
  Allocator& alloc = Allocator::get();
  const int64_t before = alloc.stats().current;
  alloc.reset_peak();
  flash_attention_forward(heads, FlashParams{sh.T, sh.T, sh.d, 0.125f, true});
  const int64_t extra = alloc.stats().peak - before;
  EXPECT_GT(extra, 0) << "work space not taken from the allocator";
  EXPECT_LT(extra, sh.T * sh.T * static_cast<int64_t>(sizeof(float)) / 10);
  EXPECT_EQ(alloc.stats().current, before);
}

// Fewer queries than keys (a KV cache): the last tq query rows against all T keys give the last
// tq rows of the full attention, within the same error bound.
TEST(FlashAttention, NewQueriesAgainstCachedKeysAreTheLastRowsOfTheFullAttention) {
  for (const Shape& sh : {Shape{2, 300, 32}, Shape{1, 70, 64}}) {
    const Problem p = make(sh, static_cast<uint32_t>(sh.T + 3));
    const int64_t T = sh.T, d = sh.d;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int64_t tq : {int64_t{1}, int64_t{5}, int64_t{65}}) {
      for (bool causal : {true, false}) {
        std::vector<float> o(static_cast<size_t>(sh.heads * tq * d), NAN);
        std::vector<float> lse(static_cast<size_t>(sh.heads * tq), NAN);
        std::vector<FlashHead> heads;
        for (int64_t h = 0; h < sh.heads; ++h)
          heads.push_back({p.q(h) + (T - tq) * p.ld, p.k(h), p.v(h), o.data() + h * tq * d,
                           lse.data() + h * tq, p.ld, p.ld, p.ld, d});
        flash_attention_forward(heads, FlashParams{tq, T, d, scale, causal});
        for (int64_t h = 0; h < sh.heads; ++h) {
          std::vector<double> y_ref, lse_ref;
          reference(p, h, scale, causal, &y_ref, &lse_ref);
          std::vector<float> pr(static_cast<size_t>(T * T)), y_naive(static_cast<size_t>(T * d)),
              st(static_cast<size_t>(T * T));
          attention_head_forward(HeadView{p.q(h), p.k(h), p.v(h), p.ld, p.ld, p.ld}, pr.data(),
                                 y_naive.data(), d, T, d, scale, causal, st.data());
          double err_flash = 0.0, err_naive = 0.0;
          for (int64_t i = 0; i < tq; ++i) {
            const int64_t r = T - tq + i;
            for (int64_t c = 0; c < d; ++c) {
              err_flash = std::max(err_flash, std::abs(o[(h * tq + i) * d + c] - y_ref[r * d + c]));
              err_naive = std::max(err_naive, std::abs(y_naive[r * d + c] - y_ref[r * d + c]));
            }
            EXPECT_NEAR(lse[h * tq + i], lse_ref[r], 1e-5 * (1.0 + std::abs(lse_ref[r])));
          }
          EXPECT_LE(err_flash, 2.0 * err_naive + 1e-6)
              << "T " << T << " tq " << tq << " causal " << causal << " head " << h;
        }
      }
    }
  }
  const float x = 0.0f;
  FlashHead h{&x, &x, &x, nullptr, nullptr, 1, 1, 1, 1};
  EXPECT_THROW(flash_attention_forward({&h, 1}, FlashParams{3, 2, 1, 1.0f, true}),
               std::invalid_argument);  // causal needs tq <= tk
}

// bf16 and f16 operands (rounded once from the same values): forward and the three gradients
// against the float64 reference on the rounded values, within twice the error of kuai's naive
// kernels on the same low-precision operands (whose outputs are rounded once too).
TEST(FlashAttention, LowPrecisionMatchesFloat64WithinTwiceTheNaiveKernelsError) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    auto round = [t](float f) { return t == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f); };
    auto widen = [t](uint16_t b) { return t == DType::kBF16 ? bf16_to_float(b) : f16_to_float(b); };
    for (const Shape& sh : {Shape{2, 70, 64}, Shape{1, 200, 32}, Shape{1, 1, 16}}) {
      for (bool causal : {true, false}) {
        Problem p = make(sh, static_cast<uint32_t>(sh.T * 13 + sh.d));
        const int64_t T = sh.T, d = sh.d, H = sh.heads;
        std::vector<uint16_t> qkv16(p.qkv.size());
        for (size_t i = 0; i < p.qkv.size(); ++i) p.qkv[i] = widen(qkv16[i] = round(p.qkv[i]));
        std::vector<float> g = kuai::test::uniform(H * T * d, -1.0f, 1.0f, 7);
        std::vector<uint16_t> g16(g.size());
        for (size_t i = 0; i < g.size(); ++i) g[i] = widen(g16[i] = round(g[i]));
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        const FlashParams fp{T, T, d, scale, causal, t};
        auto at = [&](int64_t h, int which) { return qkv16.data() + h * 3 * d + which * d; };
        std::vector<uint16_t> o(H * T * d), dqkv(H * T * 3 * d);
        std::vector<float> lse(H * T);
        std::vector<FlashHead> fwd;
        std::vector<FlashHeadGrad> bwd;
        for (int64_t h = 0; h < H; ++h) {
          fwd.push_back({at(h, 0), at(h, 1), at(h, 2), o.data() + h * T * d, lse.data() + h * T,
                         p.ld, p.ld, p.ld, d});
          uint16_t* dq = dqkv.data() + h * T * 3 * d;
          bwd.push_back({at(h, 0), at(h, 1), at(h, 2), o.data() + h * T * d, g16.data() + h * T * d,
                         lse.data() + h * T, dq, dq + d, dq + 2 * d, p.ld, p.ld, p.ld, d, d, 3 * d,
                         3 * d, 3 * d});
        }
        flash_attention_forward(fwd, fp);
        flash_attention_backward(bwd, fp);
        for (int64_t h = 0; h < H; ++h) {
          const std::vector<float> gh(g.begin() + h * T * d, g.begin() + (h + 1) * T * d);
          std::vector<double> y_ref, lse_ref, dq_ref, dk_ref, dv_ref;
          reference(p, h, scale, causal, &y_ref, &lse_ref);
          reference_backward(p, h, gh, scale, causal, &dq_ref, &dk_ref, &dv_ref);
          // The naive kernels on the same low-precision operands.
          const TypedHeadView hv{at(h, 0), at(h, 1), at(h, 2), p.ld, p.ld, p.ld, t};
          std::vector<float> pr(T * T), st(T * T);
          std::vector<uint16_t> y_naive(T * d), naive(3 * T * d);
          attention_head_forward(hv, pr.data(), y_naive.data(), d, T, d, scale, causal, st.data());
          attention_head_backward(hv, pr.data(), g16.data() + h * T * d, d, naive.data(), d,
                                  naive.data() + T * d, d, naive.data() + 2 * T * d, d, T, d, scale,
                                  causal, st.data());
          auto error = [&](const uint16_t* got, int64_t ld, const std::vector<double>& want) {
            double e = 0.0;
            for (int64_t i = 0; i < T; ++i)
              for (int64_t c = 0; c < d; ++c)
                e = std::max(e, std::abs(widen(got[i * ld + c]) - want[i * d + c]));
            return e;
          };
          const char* names[] = {"y", "dq", "dk", "dv"};
          const uint16_t* flash[] = {o.data() + h * T * d, dqkv.data() + h * T * 3 * d,
                                     dqkv.data() + h * T * 3 * d + d,
                                     dqkv.data() + h * T * 3 * d + 2 * d};
          const int64_t flash_ld[] = {d, 3 * d, 3 * d, 3 * d};
          const uint16_t* nv[] = {y_naive.data(), naive.data(), naive.data() + T * d,
                                  naive.data() + 2 * T * d};
          const std::vector<double>* refs[] = {&y_ref, &dq_ref, &dk_ref, &dv_ref};
          for (int x = 0; x < 4; ++x) {
            const double e_flash = error(flash[x], flash_ld[x], *refs[x]);
            const double e_naive = error(nv[x], d, *refs[x]);
            EXPECT_LE(e_flash, 2.0 * e_naive + 1e-6)
                << dtype_name(t) << " " << names[x] << " H " << H << " T " << T << " d " << d
                << " causal " << causal << ": naive error " << e_naive;
          }
        }
      }
    }
  }
}

// The backward's two schedules (one head per thread; heads split by blocks over threads) do the
// same products in the same order: dq, dk, dv agree bit for bit whatever the thread count.
TEST(FlashAttention, BackwardIsTheSameBitForBitWhateverTheThreads) {
  const Shape sh{2, 333, 64};
  const Problem p = make(sh, 21);
  const int64_t T = sh.T, d = sh.d, H = sh.heads;
  const std::vector<float> g = kuai::test::uniform(H * T * d, -1.0f, 1.0f, 8);
  const FlashParams fp{T, T, d, 0.125f, true};
  std::vector<float> o(H * T * d), lse(H * T);
  std::vector<FlashHead> fwd;
  for (int64_t h = 0; h < H; ++h)
    fwd.push_back(
        {p.q(h), p.k(h), p.v(h), o.data() + h * T * d, lse.data() + h * T, p.ld, p.ld, p.ld, d});
  flash_attention_forward(fwd, fp);
  auto run = [&](int threads, bool one_head_at_a_time, BlockProducts products) {
    std::vector<float> dqkv(H * T * 3 * d, NAN);
    std::vector<FlashHeadGrad> bwd;
    for (int64_t h = 0; h < H; ++h) {
      float* dq = dqkv.data() + h * T * 3 * d;
      bwd.push_back({p.q(h), p.k(h), p.v(h), o.data() + h * T * d, g.data() + h * T * d,
                     lse.data() + h * T, dq, dq + d, dq + 2 * d, p.ld, p.ld, p.ld, d, d, 3 * d,
                     3 * d, 3 * d});
    }
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    if (one_head_at_a_time) {
      for (int64_t h = 0; h < H; ++h) flash_attention_backward({&bwd[h], 1}, fp, products);
    } else {
      flash_attention_backward(bwd, fp, products);
    }
    omp_set_num_threads(saved);
    return dqkv;
  };
  for (BlockProducts products : kProducts) {
    const std::vector<float> one_thread = run(1, false, products);  // one head per thread
    for (auto [threads, split] :
         {std::pair{2, true}, std::pair{2, false}, std::pair{3, true}, std::pair{3, false}}) {
      const std::vector<float> other = run(threads, split, products);
      ASSERT_EQ(std::memcmp(one_thread.data(), other.data(), other.size() * sizeof(float)), 0)
          << threads << " threads, heads " << (split ? "one at a time" : "together") << ", "
          << block_products_name(products) << " products";
    }
  }
}

// The backward's products by measurement: the choice is recorded in the tuning cache with both
// times, is the faster of the two (swapping the comparison fails this), and stands when asked
// again; a forced choice wins; low-precision heads and calls inside a parallel region take the
// libraries without an entry.
TEST(FlashAttention, TheBackwardsProductsAreTheFasterMeasured) {
  TuningCache& cache = TuningCache::get();
  if (!cache.may_calibrate()) GTEST_SKIP() << "tuning off or read-only here";
  const FlashParams fp{64, 64, 24, 0.2f, true};  // a head_dim of its own: measured here
  const BlockProducts got = flash_products(fp);
  expect_recorded_as_the_faster(fmt::format("flash products d24 T128 t{}", omp_get_max_threads()),
                                got);
  EXPECT_EQ(flash_products(fp), got);

  const BlockProducts other =
      got == BlockProducts::kSmall ? BlockProducts::kLibrary : BlockProducts::kSmall;
  set_block_products(other);
  EXPECT_EQ(flash_products(fp), other);
  set_block_products(BlockProducts::kAuto);
  EXPECT_EQ(flash_products(fp), got);

  const FlashParams bf16{64, 64, 40, 0.2f, true, DType::kBF16};
  EXPECT_EQ(flash_products(bf16), BlockProducts::kLibrary);
  const FlashParams d40{64, 64, 40, 0.2f, true};
  BlockProducts inside = BlockProducts::kSmall;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    inside = flash_products(d40);
  }
  EXPECT_EQ(inside, BlockProducts::kLibrary);
  EXPECT_FALSE(cache.find(fmt::format("flash products d40 T128 t{}", omp_get_max_threads())));
}

}  // namespace
}  // namespace kuai::cpu
