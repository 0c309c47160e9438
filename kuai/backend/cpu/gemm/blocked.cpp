// kuai's cache-blocked fp32 GEMM (see blocked.h): the packing of op(A) blocks and op(B) slivers,
// the register tile per tier, and the loop nest with OpenMP.
#include "kuai/backend/cpu/gemm/blocked.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kuai/backend/cpu/gemm/register_tile.h"
#include "kuai/backend/cpu/gemm/small_gemm.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/core/allocator.h"

namespace kuai::cpu {
namespace {

using tile::Avx2;
using tile::Avx512;
using tile::Baseline;
using tile::Vec;
constexpr int kMR = tile::kTileRows;  // every tier's tile has six rows (register_tile.h)

// What a tile's store does with its sums s: C = alpha s + beta C + bias (the first K slice; beta
// 0 never reads C) or, for the later slices, C += alpha s.
struct Epilogue {
  float alpha = 1.0f, beta = 0.0f;
  bool accumulate = false;
};

// One thread's work on one packed A block: the row tiles of the block against B slivers
// [s_begin, s_end) of the packed panel.
struct BlockWork {
  int64_t kc;
  const float* a;       // packed block: MR-row slivers, a[t * kc * MR + k * MR + r]
  const float* a_rows;  // or, when not null, op(A) read in place: a_rows[r * lda + k] (whole
  int64_t lda;          // tiles; the last, partial one packed at a)
  int64_t rows;         // valid rows of the block
  const float* b;       // packed panel: sliver s at b + s * kc * NR, b[k * NR + c]
  int64_t s_begin, s_end;
  int64_t panel_cols;  // valid columns of the panel
  float* C;            // C at the block's first row and the panel's first column
  int64_t ldc;
  const float* bias;  // bias at the panel's first column, or null
  Epilogue e;
};

// A tile of MR rows x NV vectors: its A values packed (a[k * MR + r]) or, IN_PLACE, read from
// op(A)'s rows (a[r * lda + k]), six streams the prefetchers follow.
template <int W, int MR, int NV, bool IN_PLACE>
KUAI_KERNEL void tile(int64_t kc, const float* a, int64_t lda, const float* b, float* C,
                      int64_t ldc, int mr, int nr, const Epilogue& e, const float* bias) {
  using v = typename Vec<W>::v;
  constexpr int NR = W * NV;
  // The C lines the store will touch: fetched now, behind the multiply-adds.
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; c += 16) __builtin_prefetch(C + r * ldc + c, 1, 3);
  v acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = v{};
  for (int64_t k = 0; k < kc; ++k) {
    v bv[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&bv[j], b + k * NR + j * W, sizeof(v));
    for (int r = 0; r < MR; ++r) {
      const float av = IN_PLACE ? a[r * lda + k] : a[k * MR + r];
      for (int j = 0; j < NV; ++j) acc[r][j] += av * bv[j];
    }
  }
  if (mr == MR && nr == NR) {
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NV; ++j) {
        float* c = C + r * ldc + j * W;
        v out = e.alpha * acc[r][j];
        v old;
        if (e.accumulate) {
          std::memcpy(&old, c, sizeof(v));
          out += old;
        } else {
          if (e.beta != 0.0f) {
            std::memcpy(&old, c, sizeof(v));
            out += e.beta * old;
          }
          if (bias != nullptr) {
            v bb;
            std::memcpy(&bb, bias + j * W, sizeof(v));
            out += bb;
          }
        }
        std::memcpy(c, &out, sizeof(v));
      }
    return;
  }
  float t[MR][NR];
  std::memcpy(t, acc, sizeof(t));
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < nr; ++c) {
      float out = e.alpha * t[r][c];
      float* cc = C + r * ldc + c;
      if (e.accumulate) {
        out += *cc;
      } else {
        if (e.beta != 0.0f) out += e.beta * *cc;
        if (bias != nullptr) out += bias[c];
      }
      *cc = out;
    }
}

template <class T>
KUAI_KERNEL void block_tiles(const BlockWork& w) {
  constexpr int W = T::kW, MR = kMR, NV = T::kNV, NR = W * NV;
  for (int64_t s = w.s_begin; s < w.s_end; ++s) {
    const float* bs = w.b + s * w.kc * NR;
    const int nr = static_cast<int>(std::min<int64_t>(NR, w.panel_cols - s * NR));
    const float* bias = w.bias != nullptr ? w.bias + s * NR : nullptr;
    for (int64_t i = 0; i < w.rows; i += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, w.rows - i));
      float* c = w.C + i * w.ldc + s * NR;
      if (w.a_rows == nullptr)
        tile<W, MR, NV, false>(w.kc, w.a + i * w.kc, 0, bs, c, w.ldc, mr, nr, w.e, bias);
      else if (mr == MR)
        tile<W, MR, NV, true>(w.kc, w.a_rows + i * w.lda, w.lda, bs, c, w.ldc, mr, nr, w.e, bias);
      else
        tile<W, MR, NV, false>(w.kc, w.a, 0, bs, c, w.ldc, mr, nr, w.e, bias);
    }
  }
}

#if KUAI_HAVE_ISA_CLONES
KUAI_TARGET_AVX512 void tiles_avx512(const BlockWork& w) { block_tiles<Avx512>(w); }
KUAI_TARGET_AVX2 void tiles_avx2(const BlockWork& w) { block_tiles<Avx2>(w); }
#endif
void tiles_baseline(const BlockWork& w) { block_tiles<Baseline>(w); }

void run_tiles(Isa variant, const BlockWork& w) {
#if KUAI_HAVE_ISA_CLONES
  if (variant == Isa::kAvx512) return tiles_avx512(w);
  if (variant == Isa::kAvx2) return tiles_avx2(w);
#endif
  tiles_baseline(w);
}

template <class T>
constexpr BlockedGemmBlocking tile_of() {
  BlockedGemmBlocking b;
  b.mr = kMR;
  b.nr = T::kW * T::kNV;
  return b;
}

BlockedGemmBlocking tile_in_force(Isa variant) {
  if (variant == Isa::kAvx512) return tile_of<Avx512>();
  if (variant == Isa::kAvx2) return tile_of<Avx2>();
  return tile_of<Baseline>();
}

std::atomic<int64_t> g_mc{0}, g_kc{0}, g_nc{0};

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int64_t cache_bytes(int name, int64_t fallback) {
  const long v = sysconf(name);
  return v > 0 ? v : fallback;
}

// The block sizes from the cache sizes. KC: a B sliver and an A sliver (KC x (NR + MR) floats)
// take a quarter of L2, so both stream from L2 while the tile's accumulators stay in registers,
// and C is loaded and stored once per KC multiply-adds (the deeper the slice, the less that
// costs: on an Emerald Rapids core, KC 128 ran 1024^3 at 127 GFLOP/s, 384-768 at 158-162);
// between 256 and 2048. MC: the A block (MC x KC) half of L2. NC: the shared B panel (KC x NC)
// a quarter of the last-level cache, at most 4096 columns.
BlockedGemmBlocking blocking_for(Isa variant) {
  BlockedGemmBlocking b = tile_in_force(variant);
  static const int64_t l2 = cache_bytes(_SC_LEVEL2_CACHE_SIZE, 1 << 20);
  static const int64_t l3 = cache_bytes(_SC_LEVEL3_CACHE_SIZE, 8 << 20);
  const int64_t kc_env = g_kc.load(std::memory_order_relaxed);
  const int64_t mc_env = g_mc.load(std::memory_order_relaxed);
  const int64_t nc_env = g_nc.load(std::memory_order_relaxed);
  b.kc =
      kc_env > 0 ? kc_env : std::clamp<int64_t>(l2 / 4 / ((b.nr + b.mr) * 4) / 64 * 64, 256, 2048);
  b.mc = mc_env > 0
             ? round_up(mc_env, b.mr)
             : std::clamp<int64_t>(l2 / 2 / (b.kc * 4) / b.mr * b.mr, b.mr, 1024 / b.mr * b.mr);
  b.nc = nc_env > 0
             ? round_up(nc_env, b.nr)
             : std::clamp<int64_t>(l3 / 4 / (b.kc * 4) / b.nr * b.nr, b.nr, 4096 / b.nr * b.nr);
  return b;
}

// op(A) rows [i0, i0 + rows) by K [p0, p0 + kc) into MR-row slivers, sliver t at dst + t * kc *
// MR holding dst[k * MR + r] (rows past `rows` zero), so a tile reads its A values in one stream.
// A non-transposed A goes through `tmp` (kc x rows, from the 8 x 8 transposes) first.
KUAI_KERNEL void pack_a_kernel(const float* A, int64_t lda, bool trans, int64_t i0, int64_t rows,
                               int64_t p0, int64_t kc, float* dst, float* tmp) {
  constexpr int64_t MR = kMR;
  const float* src = A + i0 + p0 * lda;  // op(A)(i0 + r, p0 + k) = src[k * ld + r]
  int64_t ld = lda;
  if (!trans) {
    transpose_floats(A + i0 * lda + p0, lda, rows, kc, tmp, rows);
    src = tmp;
    ld = rows;
  }
  // A few rows of src at a time, each copied into every sliver: the rows' lines are read once
  // while in L1 (sliver by sliver over the whole depth, a transposed A's row stride of M floats
  // brought each line in again from L2 for every sliver it feeds).
  constexpr int64_t kRows = 16;
  for (int64_t k0 = 0; k0 < kc; k0 += kRows) {
    const int64_t k1 = std::min(kc, k0 + kRows);
    for (int64_t t = 0; t * MR < rows; ++t) {
      const int64_t mr = std::min(MR, rows - t * MR);
      float* d = dst + t * kc * MR;
      const float* from = src + t * MR;
      if (mr == MR) {  // a fixed-size copy the compiler inlines
        for (int64_t k = k0; k < k1; ++k)
          std::memcpy(d + k * MR, from + k * ld, MR * sizeof(float));
      } else {
        for (int64_t k = k0; k < k1; ++k)
          for (int64_t r = 0; r < MR; ++r) d[k * MR + r] = r < mr ? from[k * ld + r] : 0.0f;
      }
    }
  }
}

// op(B) rows [p0, p0 + kc) by columns [j0, j0 + nr) into dst[k * NR + c] (columns past nr zero).
KUAI_KERNEL void pack_b_kernel(const float* B, int64_t ldb, bool trans, int64_t p0, int64_t kc,
                               int64_t j0, int64_t nr, int64_t NR, float* dst) {
  if (trans) {
    transpose_floats(B + j0 * ldb + p0, ldb, nr, kc, dst, NR);
  } else {
    const float* src = B + p0 * ldb + j0;
    // A whole sliver's row is a copy of fixed size the compiler inlines (a call per row of 64
    // floats took a tenth of a 256-row weight gradient's time).
    auto rows = [&](auto width) {
      for (int64_t k = 0; k < kc; ++k) std::memcpy(dst + k * NR, src + k * ldb, width * 4);
    };
    if (nr == 64 && NR == 64)
      rows(std::integral_constant<size_t, 64>());
    else if (nr == 16 && NR == 16)
      rows(std::integral_constant<size_t, 16>());
    else if (nr == 8 && NR == 8)
      rows(std::integral_constant<size_t, 8>());
    else
      rows(static_cast<size_t>(nr));
  }
  if (nr < NR)
    for (int64_t k = 0; k < kc; ++k) std::fill(dst + k * NR + nr, dst + (k + 1) * NR, 0.0f);
}

// The packing copies compiled per tier (vector moves of the tier's width).
KUAI_CLONE(pack_a, pack_a_kernel)
KUAI_CLONE(pack_b, pack_b_kernel)

// A product's slices, row blocks and buffers (floats), as gemm_blocked takes them.
struct Sizes {
  int64_t kc_max, m_blocks, mc_even;
  int64_t b_floats;    // the packed B panel
  int64_t a_floats;    // per thread: the packed A block (transposed A), else a last partial tile
  int64_t tmp_floats;  // per thread: that tile's transpose
  int threads;
};
Sizes sizes_for(const BlockedGemmBlocking& blk, bool trans_a, int64_t M, int64_t N, int64_t K) {
  Sizes z;
  // K in slices of equal depth, the depth a function of K alone.
  const int64_t slices = (K + blk.kc - 1) / blk.kc;
  z.kc_max = (K + slices - 1) / slices;
  z.threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  // Row blocks of equal size, as many as a multiple of the threads.
  int64_t m_blocks = (M + blk.mc - 1) / blk.mc;
  m_blocks = (m_blocks + z.threads - 1) / z.threads * z.threads;
  z.mc_even = round_up((M + m_blocks - 1) / m_blocks, blk.mr);
  z.m_blocks = (M + z.mc_even - 1) / z.mc_even;
  z.b_floats = z.kc_max * std::min(blk.nc, round_up(N, blk.nr));
  z.a_floats = round_up((trans_a ? z.mc_even : blk.mr) * z.kc_max, 16);
  z.tmp_floats = trans_a ? 0 : round_up(blk.mr * z.kc_max, 16);
  return z;
}

}  // namespace

BlockedGemmBlocking blocked_gemm_blocking() { return blocking_for(clone_variant()); }

std::vector<int64_t> gemm_blocked_scratch_bytes(bool trans_a, bool trans_b, int64_t M, int64_t N,
                                                int64_t K) {
  (void)trans_b;
  if (M <= 0 || N <= 0 || K <= 0) return {};
  const Sizes z = sizes_for(blocking_for(clone_variant()), trans_a, M, N, K);
  const int64_t f = sizeof(float);
  return {z.b_floats * f, (z.a_floats + z.tmp_floats) * z.threads * f};
}

void set_blocked_gemm_blocking(int64_t mc, int64_t kc, int64_t nc) {
  g_mc.store(std::max<int64_t>(mc, 0), std::memory_order_relaxed);
  g_kc.store(std::max<int64_t>(kc, 0), std::memory_order_relaxed);
  g_nc.store(std::max<int64_t>(nc, 0), std::memory_order_relaxed);
}

void gemm_blocked(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc, const float* bias) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0 || alpha == 0.0f) {  // no product: C = beta C + bias
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        float& c = C[i * ldc + j];
        c = (beta == 0.0f ? 0.0f : beta * c) + (bias != nullptr ? bias[j] : 0.0f);
      }
    return;
  }
  const Isa variant = clone_variant();
  const BlockedGemmBlocking blk = blocking_for(variant);
  const Sizes z = sizes_for(blk, trans_a, M, N, K);
  const int64_t MR = blk.mr, NR = blk.nr, kc_max = z.kc_max, m_blocks = z.m_blocks;
  const int64_t mc_even = z.mc_even, a_stride = z.a_floats + z.tmp_floats;
  const int nt = z.threads;
  ScratchFloats b_pack(z.b_floats);
  ScratchFloats a_pack(a_stride * nt);
  Epilogue first{alpha, beta, false}, later{alpha, 0.0f, true};

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    float* ap = a_pack.data() + tid * a_stride;
    float* tmp = ap + z.a_floats;
    // Columns split between the threads too when the row blocks do not divide evenly among them
    // (a product of a few rows); each part packs its own copy of the A block then.
    const int64_t col_parts = m_blocks % nth == 0 ? 1 : nth;
    for (int64_t jc = 0; jc < N; jc += blk.nc) {
      const int64_t nc = std::min(blk.nc, N - jc), slivers = (nc + NR - 1) / NR;
      for (int64_t pc = 0; pc < K; pc += kc_max) {
        const int64_t kc = std::min(kc_max, K - pc);
        int64_t packed_block = -1;  // the row block this thread's A buffer holds for this slice
#pragma omp for schedule(static)
        for (int64_t s = 0; s < slivers; ++s) {
          pack_b(B, ldb, trans_b, pc, kc, jc + s * NR, std::min(NR, nc - s * NR), NR,
                 b_pack.data() + s * kc * NR);
        }
        // Handed out one at a time: on a shared host one core is often slower than the other,
        // and a static split left the faster one waiting at the barrier for a tenth of the time.
        // (Which thread computes a block never changes its bits.)
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < m_blocks * col_parts; ++item) {
          const int64_t ib = item / col_parts, part = item % col_parts;
          const int64_t s_begin = slivers * part / col_parts;
          const int64_t s_end = slivers * (part + 1) / col_parts;
          if (s_begin == s_end) continue;
          const int64_t i0 = ib * mc_even, rows = std::min(mc_even, M - i0);
          // A non-transposed A is read in place (its rows are the tiles' streams) but for a last
          // partial tile, packed.
          const float* a_rows = trans_a ? nullptr : A + i0 * lda + pc;
          if (ib != packed_block) {
            if (trans_a) {
              pack_a(A, lda, trans_a, i0, rows, pc, kc, ap, tmp);
            } else if (rows % MR != 0) {
              const int64_t whole = rows / MR * MR;
              pack_a(A, lda, trans_a, i0 + whole, rows - whole, pc, kc, ap, tmp);
            }
            packed_block = ib;
          }
          BlockWork w{kc,
                      ap,
                      a_rows,
                      lda,
                      rows,
                      b_pack.data(),
                      s_begin,
                      s_end,
                      nc,
                      C + i0 * ldc + jc,
                      ldc,
                      bias != nullptr && pc == 0 ? bias + jc : nullptr,
                      pc == 0 ? first : later};
          run_tiles(variant, w);
        }
      }
    }
  }
}

}  // namespace kuai::cpu
