// The converting, cache-blocked GEMM (see gemm_packed.h): packing of op(A) into 6-row slivers and
// of op(B) into 16-column slivers with the widening to fp32 done on the way, the 6x16 AVX2+FMA
// micro-kernel, the tile store that applies alpha, beta and the bias and rounds a low-precision C,
// and the BLIS loop nest with OpenMP. The naive oracle it is tested against is
// gemm_lowp_reference (gemm_lowp.h).
#include "kuai/backend/cpu/gemm/packed.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include "kuai/backend/cpu/isa.h"
#include "kuai/core/allocator.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KUAI_PACKED_GEMM 1
#define KUAI_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define KUAI_PACKED_GEMM 0
#endif

namespace kuai::cpu {
namespace {

constexpr int kMR = 6;   // rows of the micro-tile (A sliver height)
constexpr int kNR = 16;  // columns of the micro-tile (B sliver width): two ymm registers
// Defaults for 32 KiB L1d, 512 KiB-1 MiB L2 per core, a shared L3 of several MiB: the A block
// (MC x KC fp32, 432 KiB) stays in L2 while a B sliver (KC x 16, 48 KiB) streams through L1; the
// packed B panel (KC x NC, 9 MiB) is shared from L3. Tuned on the 2-core AVX2 EPYC with
// bench/bench_gemm_lowp.cpp and whole GPT-2-shape steps: KC 256 (BLIS's choice for Zen) stores
// and reloads C once more per 256 of K and measured 5-10% below KC 512 and 768; KC 768 keeps
// GPT-2's K = 768 products in one slice (a bf16 C then needs no fp32 accumulator) and took the
// bf16 step's linear layers from 6.50 to 6.29 s per 4 steps against 512; KC 1024 and MC 72, 96,
// 192, 240 were no better. Even-sized row blocks (a multiple of the thread count) and prefetching
// the C tile while the micro-kernel runs took the first version from 130 to 155-165 GFLOP/s on
// gpt2's qkv.
constexpr int64_t kDefaultMC = 144, kDefaultKC = 768, kDefaultNC = 3072;
constexpr int64_t kDefaultCBudget = int64_t{1} << 22;  // 16 MiB of fp32 accumulators

std::atomic<int64_t> g_mc{0}, g_kc{0}, g_nc{0}, g_c_budget{0};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

PackedGemmBlocking blocks_in_force() {
  PackedGemmBlocking b;
  const int64_t mc = g_mc.load(std::memory_order_relaxed);
  const int64_t kc = g_kc.load(std::memory_order_relaxed);
  const int64_t nc = g_nc.load(std::memory_order_relaxed);
  const int64_t cb = g_c_budget.load(std::memory_order_relaxed);
  b.mc = round_up(mc > 0 ? mc : kDefaultMC, kMR);
  b.kc = kc > 0 ? kc : kDefaultKC;
  b.nc = round_up(nc > 0 ? nc : kDefaultNC, kNR);
  b.c_budget = cb > 0 ? cb : kDefaultCBudget;
  return b;
}

// The packing buffers of a product small enough to run on one thread (the per-head products of
// attention, called from inside a parallel loop) come from two per-thread buffers kept between
// calls (at most 2 x 1 MiB per thread, like attention's own per-thread scratch); a call costs
// no allocator round trip then. Larger products take theirs from the tracking allocator.
constexpr int64_t kLocalPackFloats = int64_t{1} << 18;

class PackBuffer {
 public:
  PackBuffer(int64_t count, bool one_thread, int slot) {
    if (one_thread && count <= kLocalPackFloats) {
      thread_local std::vector<float> local[2];
      std::vector<float>& v = local[slot];
      if (static_cast<int64_t>(v.size()) < count) v.resize(static_cast<size_t>(count));
      data_ = v.data();
    } else {
      scratch_.emplace(count);
      data_ = scratch_->data();
    }
  }
  float* data() const { return data_; }

 private:
  std::optional<ScratchFloats> scratch_;
  float* data_ = nullptr;
};

#if KUAI_PACKED_GEMM

// ---- loads and stores of 8 (or 1) elements of a storage type, as fp32 ----

template <DType T>
KUAI_AVX2 inline __m256 load8(const void* base, int64_t i) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <DType T>
inline float load1(const void* base, int64_t i) {
  if constexpr (T == DType::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == DType::kBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  } else {
    return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// Round to nearest even exactly as float_to_bf16 (dtype.h) does, NaNs quieted.
KUAI_AVX2 inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  // 32-bit lanes (all < 2^16) to 16 bits: pack within 128-bit halves, then gather the halves.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

template <DType T>
KUAI_AVX2 inline void store8(void* base, int64_t i, __m256 v) {
  if constexpr (T == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, v);
  } else {
    auto* p = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i);
    if constexpr (T == DType::kBF16) {
      _mm_storeu_si128(p, to_bf16x8(v));
    } else {
      _mm_storeu_si128(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }
}

template <DType T>
inline void store1(void* base, int64_t i, float v) {
  if constexpr (T == DType::kF32) {
    static_cast<float*>(base)[i] = v;
  } else if constexpr (T == DType::kBF16) {
    static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_f16(v);
  }
}

// In-place transpose of the 8x8 block held in r[0..7] (row i in r[i] -> column i in r[i]).
KUAI_AVX2 inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// ---- packing ----

// One A sliver: op(A) rows [i0, i0 + mr) (mr <= 6) by K [p0, p0 + kc), into dst[k * 6 + r], rows
// past mr zero. op(A) has m_total rows. The vector paths store 8 floats at dst + k * 6, the last
// two of which the next k overwrites; the one past the end lands in the next sliver (packed
// after this one) or in the block's padding.
template <DType T>
KUAI_AVX2 void pack_a_sliver(const void* A, int64_t lda, bool trans, int64_t i0, int mr,
                             int64_t m_total, int64_t p0, int64_t kc, float* dst) {
  int64_t k = 0;
  if (!trans) {  // op(A)[i][p] = A[i * lda + p]: six rows, each contiguous in k
    if (mr == kMR) {
      for (; k + 8 <= kc; k += 8) {
        __m256 r[8];
        for (int i = 0; i < kMR; ++i) r[i] = load8<T>(A, (i0 + i) * lda + p0 + k);
        r[6] = r[7] = _mm256_setzero_ps();
        transpose8(r);
        for (int kk = 0; kk < 8; ++kk) _mm256_storeu_ps(dst + (k + kk) * kMR, r[kk]);
      }
    }
    for (; k < kc; ++k) {
      for (int i = 0; i < kMR; ++i)
        dst[k * kMR + i] = i < mr ? load1<T>(A, (i0 + i) * lda + p0 + k) : 0.0f;
    }
  } else {  // op(A)[i][p] = A[p * lda + i]: the six values of one k are contiguous
    if (mr == kMR && i0 + 8 <= m_total) {
      for (; k < kc; ++k) _mm256_storeu_ps(dst + k * kMR, load8<T>(A, (p0 + k) * lda + i0));
    }
    for (; k < kc; ++k) {
      for (int i = 0; i < kMR; ++i)
        dst[k * kMR + i] = i < mr ? load1<T>(A, (p0 + k) * lda + i0 + i) : 0.0f;
    }
  }
}

// One B sliver: op(B) rows [p0, p0 + kc) by columns [j0, j0 + nr) (nr <= 16), into
// dst[k * 16 + c], columns past nr zero.
template <DType T>
KUAI_AVX2 void pack_b_sliver(const void* B, int64_t ldb, bool trans, int64_t p0, int64_t kc,
                             int64_t j0, int nr, float* dst) {
  if (!trans) {  // op(B)[p][j] = B[p * ldb + j]: sixteen contiguous values per k
    if (nr == kNR) {
      for (int64_t k = 0; k < kc; ++k) {
        const int64_t at = (p0 + k) * ldb + j0;
        _mm256_storeu_ps(dst + k * kNR, load8<T>(B, at));
        _mm256_storeu_ps(dst + k * kNR + 8, load8<T>(B, at + 8));
      }
      return;
    }
    for (int64_t k = 0; k < kc; ++k) {
      for (int c = 0; c < kNR; ++c)
        dst[k * kNR + c] = c < nr ? load1<T>(B, (p0 + k) * ldb + j0 + c) : 0.0f;
    }
    return;
  }
  // op(B)[p][j] = B[j * ldb + p]: sixteen rows of B, each contiguous in k; 8x8 transposes.
  int64_t k = 0;
  if (nr == kNR) {
    for (; k + 8 <= kc; k += 8) {
      for (int h = 0; h < 2; ++h) {
        __m256 r[8];
        for (int c = 0; c < 8; ++c) r[c] = load8<T>(B, (j0 + 8 * h + c) * ldb + p0 + k);
        transpose8(r);
        for (int kk = 0; kk < 8; ++kk) _mm256_storeu_ps(dst + (k + kk) * kNR + 8 * h, r[kk]);
      }
    }
  }
  for (; k < kc; ++k) {
    for (int c = 0; c < kNR; ++c)
      dst[k * kNR + c] = c < nr ? load1<T>(B, (j0 + c) * ldb + p0 + k) : 0.0f;
  }
}

// ---- the micro-kernel: tile(6, 16) = sum over k of a[k * 6 + r] * b[k * 16 + c] ----

KUAI_AVX2 void micro_kernel(int64_t kc, const float* a, const float* b, float* tile,
                            const char* c_next, int64_t ldc_bytes) {
  // The C rows the tile store will read: fetched now, hidden behind the FMAs.
  for (int r = 0; r < kMR; ++r) {
    _mm_prefetch(c_next + r * ldc_bytes, _MM_HINT_T0);
    _mm_prefetch(c_next + r * ldc_bytes + 63, _MM_HINT_T0);
  }
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    __m256 a0 = _mm256_broadcast_ss(a);
    c00 = _mm256_fmadd_ps(a0, b0, c00);
    c01 = _mm256_fmadd_ps(a0, b1, c01);
    a0 = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(a0, b0, c10);
    c11 = _mm256_fmadd_ps(a0, b1, c11);
    a0 = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(a0, b0, c20);
    c21 = _mm256_fmadd_ps(a0, b1, c21);
    a0 = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(a0, b0, c30);
    c31 = _mm256_fmadd_ps(a0, b1, c31);
    a0 = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(a0, b0, c40);
    c41 = _mm256_fmadd_ps(a0, b1, c41);
    a0 = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(a0, b0, c50);
    c51 = _mm256_fmadd_ps(a0, b1, c51);
    a += kMR;
    b += kNR;
  }
  _mm256_storeu_ps(tile + 0, c00);
  _mm256_storeu_ps(tile + 8, c01);
  _mm256_storeu_ps(tile + 16, c10);
  _mm256_storeu_ps(tile + 24, c11);
  _mm256_storeu_ps(tile + 32, c20);
  _mm256_storeu_ps(tile + 40, c21);
  _mm256_storeu_ps(tile + 48, c30);
  _mm256_storeu_ps(tile + 56, c31);
  _mm256_storeu_ps(tile + 64, c40);
  _mm256_storeu_ps(tile + 72, c41);
  _mm256_storeu_ps(tile + 80, c50);
  _mm256_storeu_ps(tile + 88, c51);
}

// ---- the tile store ----

// What a tile store does with the fp32 sums s: C = alpha s + beta C + bias (the first K slice;
// beta == 0 never reads C) or, for the later K slices of an fp32 C, C += alpha s.
struct Epilogue {
  float alpha = 1.0f, beta = 0.0f;
  const float* bias = nullptr;  // fp32, indexed by the column of C
  bool accumulate = false;
};

// Stores the (mr, nr) corner of the fp32 tile (row stride ldt) into C at (i, j).
template <DType TC>
KUAI_AVX2 void store_tile(const float* tile, int64_t ldt, int mr, int nr, void* C, int64_t ldc,
                          int64_t i, int64_t j, const Epilogue& e) {
  const __m256 alpha = _mm256_set1_ps(e.alpha), beta = _mm256_set1_ps(e.beta);
  for (int r = 0; r < mr; ++r) {
    const int64_t row = (i + r) * ldc + j;
    int c = 0;
    for (; c + 8 <= nr; c += 8) {
      __m256 v = _mm256_loadu_ps(tile + r * ldt + c);
      if (e.alpha != 1.0f) v = _mm256_mul_ps(v, alpha);
      if (e.accumulate) {
        v = _mm256_add_ps(load8<TC>(C, row + c), v);
      } else {
        if (e.beta != 0.0f) v = _mm256_add_ps(v, _mm256_mul_ps(beta, load8<TC>(C, row + c)));
        if (e.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(e.bias + j + c));
      }
      store8<TC>(C, row + c, v);
    }
    for (; c < nr; ++c) {
      float v = tile[r * ldt + c];
      if (e.alpha != 1.0f) v = v * e.alpha;
      if (e.accumulate) {
        v = load1<TC>(C, row + c) + v;
      } else {
        if (e.beta != 0.0f) v = v + e.beta * load1<TC>(C, row + c);
        if (e.bias != nullptr) v = v + e.bias[j + c];
      }
      store1<TC>(C, row + c, v);
    }
  }
}

using PackAFn = void (*)(const void*, int64_t, bool, int64_t, int, int64_t, int64_t, int64_t,
                         float*);
using PackBFn = void (*)(const void*, int64_t, bool, int64_t, int64_t, int64_t, int, float*);
using StoreFn = void (*)(const float*, int64_t, int, int, void*, int64_t, int64_t, int64_t,
                         const Epilogue&);

template <template <DType> class Pick>
auto pick(DType t) {
  switch (t) {
    case DType::kBF16:
      return Pick<DType::kBF16>::fn;
    case DType::kF16:
      return Pick<DType::kF16>::fn;
    default:
      return Pick<DType::kF32>::fn;
  }
}
template <DType T>
struct PickA {
  static constexpr PackAFn fn = &pack_a_sliver<T>;
};
template <DType T>
struct PickB {
  static constexpr PackBFn fn = &pack_b_sliver<T>;
};
template <DType T>
struct PickStore {
  static constexpr StoreFn fn = &store_tile<T>;
};

// C (type c_dtype) = the epilogue applied to op(A) op(B); K > kc needs an fp32 C (later slices
// accumulate). op(A) may be a block of rows of a matrix with m_total rows from the first.
void run_blocked(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, int64_t m_total,
                 const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype,
                 int64_t ldb, void* C, DType c_dtype, int64_t ldc, const Epilogue& first,
                 const PackedGemmBlocking& blk) {
  const PackAFn pack_a = pick<PickA>(a_dtype);
  const PackBFn pack_b = pick<PickB>(b_dtype);
  const StoreFn store = pick<PickStore>(c_dtype);
  const int64_t kc_max = std::min(blk.kc, K), nc_max = std::min(blk.nc, round_up(N, kNR));
  const int64_t mc_max = std::min(blk.mc, round_up(M, kMR)) + kMR;  // even blocks may be longer
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * K;
  const int nt = omp_in_parallel() || flops < 2e6 ? 1 : omp_get_max_threads();
  const int64_t a_stride = mc_max * kc_max + 2 * kNR;  // + room for the overlapping stores
  PackBuffer b_pack(kc_max * nc_max + 2 * kNR, nt == 1, 0);
  PackBuffer a_pack(a_stride * nt, nt == 1, 1);
  Epilogue later;
  later.alpha = first.alpha;
  later.accumulate = true;
  const char* c_bytes = static_cast<const char*>(C);
  const int64_t c_es = dtype_size(c_dtype);
  // Row blocks of equal size, as many as a multiple of the threads: no thread waits on a short
  // last block. Block sizes never change a result (only K slices order the sums).
  int64_t m_blocks = (M + blk.mc - 1) / blk.mc;
  m_blocks = (m_blocks + nt - 1) / nt * nt;
  const int64_t mc_even = round_up((M + m_blocks - 1) / m_blocks, kMR);
  m_blocks = (M + mc_even - 1) / mc_even;

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    float* ap = a_pack.data() + tid * a_stride;
    alignas(32) float tile[kMR * kNR];
    // Split the columns of a panel between threads too when there are few row blocks; each
    // part then packs its own copy of the A block (cheap next to the product when M is small).
    const int64_t col_parts = m_blocks >= 2 * nth ? 1 : nth;
    for (int64_t jc = 0; jc < N; jc += blk.nc) {
      const int64_t nc = std::min(blk.nc, N - jc), slivers = (nc + kNR - 1) / kNR;
      for (int64_t pc = 0; pc < K; pc += blk.kc) {
        const int64_t kc = std::min(blk.kc, K - pc);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < slivers; ++s) {
          pack_b(B, ldb, trans_b, pc, kc, jc + s * kNR,
                 static_cast<int>(std::min<int64_t>(kNR, nc - s * kNR)),
                 b_pack.data() + s * kc * kNR);
        }
        const Epilogue& e = pc == 0 ? first : later;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < m_blocks * col_parts; ++item) {
          const int64_t ib = item / col_parts, part = item % col_parts;
          const int64_t s_begin = slivers * part / col_parts;
          const int64_t s_end = slivers * (part + 1) / col_parts;
          if (s_begin == s_end) continue;
          const int64_t i0 = ib * mc_even, mc = std::min(mc_even, M - i0);
          const int64_t a_slivers = (mc + kMR - 1) / kMR;
          for (int64_t t = 0; t < a_slivers; ++t) {
            pack_a(A, lda, trans_a, i0 + t * kMR,
                   static_cast<int>(std::min<int64_t>(kMR, mc - t * kMR)), m_total, pc, kc,
                   ap + t * kc * kMR);
          }
          for (int64_t s = s_begin; s < s_end; ++s) {
            const int nr = static_cast<int>(std::min<int64_t>(kNR, nc - s * kNR));
            const float* bs = b_pack.data() + s * kc * kNR;
            for (int64_t t = 0; t < a_slivers; ++t) {
              micro_kernel(kc, ap + t * kc * kMR, bs, tile,
                           c_bytes + ((i0 + t * kMR) * ldc + jc + s * kNR) * c_es, ldc * c_es);
              store(tile, kNR, static_cast<int>(std::min<int64_t>(kMR, mc - t * kMR)), nr, C, ldc,
                    i0 + t * kMR, jc + s * kNR, e);
            }
          }
        }
      }
    }
  }
}

#endif  // KUAI_PACKED_GEMM

}  // namespace

bool packed_gemm_available() {
#if KUAI_PACKED_GEMM
  return isa() >= Isa::kAvx2;  // the tier in force (KUAI_MAX_ISA caps it)
#else
  return false;
#endif
}

void set_packed_gemm_blocking(PackedGemmBlocking b) {
  g_mc.store(std::max<int64_t>(b.mc, 0), std::memory_order_relaxed);
  g_kc.store(std::max<int64_t>(b.kc, 0), std::memory_order_relaxed);
  g_nc.store(std::max<int64_t>(b.nc, 0), std::memory_order_relaxed);
  g_c_budget.store(std::max<int64_t>(b.c_budget, 0), std::memory_order_relaxed);
}

PackedGemmBlocking packed_gemm_blocking() { return blocks_in_force(); }

void gemm_packed(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype,
                 int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc, const float* bias) {
#if KUAI_PACKED_GEMM
  if (!packed_gemm_available())
    throw std::logic_error("gemm_packed: this CPU lacks AVX2, FMA or F16C");
  if (M <= 0 || N <= 0) return;
  PackedGemmBlocking blk = blocks_in_force();
  // K in slices of equal depth (768 = 2 x 384, not 512 + 256): the depth depends on K only.
  const int64_t slices = K > 0 ? (K + blk.kc - 1) / blk.kc : 1;
  blk.kc = K > 0 ? (K + slices - 1) / slices : blk.kc;
  Epilogue first;
  first.alpha = alpha;
  first.beta = beta;
  first.bias = bias;
  const StoreFn store = pick<PickStore>(c_dtype);
  if (K <= 0) {  // no product: C = beta C + bias
    const float zeros[kNR] = {};
#pragma omp parallel for schedule(static) if (M * N > (1 << 16) && !omp_in_parallel())
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; j += kNR)
        store(zeros, 0, 1, static_cast<int>(std::min<int64_t>(kNR, N - j)), C, ldc, i, j, first);
    }
    return;
  }
  if (c_dtype == DType::kF32 || K <= blk.kc) {
    run_blocked(trans_a, trans_b, M, N, K, M, A, a_dtype, lda, B, b_dtype, ldb, C, c_dtype, ldc,
                first, blk);
    return;
  }
  // A low-precision C over several K slices: the sums of a block of C stay fp32 in a bounded
  // accumulator until the whole K is in, then are rounded into C once (with beta C added). The
  // blocks are whole rows when C is taller than wide (op(B) is packed once per block), else whole
  // columns (op(A) is packed once per block), so the operand packed again is the smaller one.
  const bool by_rows = M >= N;
  const int64_t other = by_rows ? N : M, length = by_rows ? M : N;
  const int64_t unit = by_rows ? kMR : kNR;
  int64_t step = std::max<int64_t>(1, blk.c_budget / other);
  if (step >= unit) step = step / unit * unit;
  step = std::min(step, length);
  ScratchFloats acc(step * other);
  Epilogue into_acc;
  into_acc.alpha = alpha;
  Epilogue finish;
  finish.beta = beta;
  const int64_t a_es = dtype_size(a_dtype), b_es = dtype_size(b_dtype), c_es = dtype_size(c_dtype);
  for (int64_t at = 0; at < length; at += step) {
    const int64_t len = std::min(step, length - at);
    const int64_t m = by_rows ? len : M, n = by_rows ? N : len;
    const int64_t i0 = by_rows ? at : 0, j0 = by_rows ? 0 : at;
    const char* a0 = static_cast<const char*>(A) + (trans_a ? i0 : i0 * lda) * a_es;
    const char* b0 = static_cast<const char*>(B) + (trans_b ? j0 * ldb : j0) * b_es;
    into_acc.bias = bias != nullptr ? bias + j0 : nullptr;
    run_blocked(trans_a, trans_b, m, n, K, M - i0, a0, a_dtype, lda, b0, b_dtype, ldb, acc.data(),
                DType::kF32, n, into_acc, blk);
    char* c0 = static_cast<char*>(C) + (i0 * ldc + j0) * c_es;
#pragma omp parallel for schedule(static) if (m * n > (1 << 16) && !omp_in_parallel())
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; j += kNR) {
        store(acc.data() + i * n + j, 0, 1, static_cast<int>(std::min<int64_t>(kNR, n - j)), c0,
              ldc, i, j, finish);
      }
    }
  }
#else
  (void)trans_a, (void)trans_b, (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)a_dtype;
  (void)lda, (void)B, (void)b_dtype, (void)ldb, (void)beta, (void)C, (void)c_dtype, (void)ldc;
  (void)bias;
  throw std::logic_error("gemm_packed: not compiled for this architecture");
#endif
}

}  // namespace kuai::cpu
