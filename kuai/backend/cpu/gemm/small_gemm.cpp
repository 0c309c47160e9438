// The register-blocked small GEMM (see small_gemm.h). One body, written with GCC vector types,
// compiled three times: 16-float vectors for the AVX-512 tiers, 8 for AVX2, 4 (SSE2 or the
// portable lowering) for the baseline; the tier in force picks the copy, as KUAI_CLONE does.
#include "kuai/backend/cpu/gemm/small_gemm.h"

#include <algorithm>
#include <cstring>

#include "kuai/backend/cpu/gemm/register_tile.h"
#include "kuai/backend/cpu/isa.h"

namespace kuai::cpu {
namespace {

using tile::Avx2;
using tile::Avx512;
using tile::Baseline;
using tile::Vec;
constexpr int kMR = tile::kTileRows;  // the micro-tile per tier: 6 rows x NV vectors of W floats

struct Args {
  bool ta;
  int64_t M, N, K;
  float alpha;
  const float* A;
  int64_t lda;
  const float* B;  // op(B) row-major (K, N) with row stride ldb
  int64_t ldb;
  float beta;
  float* C;
  int64_t ldc;
};

// C tile (MR rows, NV vectors of W) = alpha * sum_k op(A)(r, k) B(k, :) + beta * C; of the last
// vector, the first `skip` lanes are not stored (a window reaching back over columns already
// done, so that a product's last few columns still run in vector lanes).
template <int W, int MR, int NV, bool TA>
KUAI_KERNEL void tile(int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                      int64_t ldb, float beta, float* C, int64_t ldc, int skip) {
  using v = typename Vec<W>::v;
  v acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = v{};
  for (int64_t k = 0; k < K; ++k) {
    v b[NV];
    for (int j = 0; j < NV; ++j) std::memcpy(&b[j], B + k * ldb + j * W, sizeof(v));
    for (int r = 0; r < MR; ++r) {
      const float a = TA ? A[k * lda + r] : A[r * lda + k];
      for (int j = 0; j < NV; ++j) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) {
      float* c = C + r * ldc + j * W;
      v out = alpha * acc[r][j];
      if (beta != 0.0f) {
        v old;
        std::memcpy(&old, c, sizeof(v));
        out += beta * old;
      }
      if (skip == 0 || j < NV - 1) {
        std::memcpy(c, &out, sizeof(v));
      } else {
        float lanes[W];
        std::memcpy(lanes, &out, sizeof(v));
        for (int l = skip; l < W; ++l) c[l] = lanes[l];
      }
    }
}

// Products narrower than 4 columns: one scalar sum per element.
template <bool TA>
KUAI_KERNEL void tile_scalar(int mr, int nc, int64_t K, float alpha, const float* A, int64_t lda,
                             const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  for (int r = 0; r < mr; ++r)
    for (int c = 0; c < nc; ++c) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += (TA ? A[k * lda + r] : A[r * lda + k]) * B[k * ldb + c];
      float out = alpha * s;
      if (beta != 0.0f) out += beta * C[r * ldc + c];
      C[r * ldc + c] = out;
    }
}

// tile<W, mr, NV, TA> for the run-time mr in [1, MR].
template <int W, int NV, bool TA, int MR>
KUAI_KERNEL void rows(int mr, const Args& a, const float* A, const float* B, float* C,
                      int skip = 0) {
  if constexpr (MR > 0) {
    if (mr == MR)
      tile<W, MR, NV, TA>(a.K, a.alpha, A, a.lda, B, a.ldb, a.beta, C, a.ldc, skip);
    else
      rows<W, NV, TA, MR - 1>(mr, a, A, B, C, skip);
  }
}
// The same for the run-time nv in [1, NV].
template <int W, bool TA, int NV>
KUAI_KERNEL void cols(int nv, int mr, const Args& a, const float* A, const float* B, float* C) {
  if constexpr (NV > 0) {
    if (nv == NV)
      rows<W, NV, TA, kMR>(mr, a, A, B, C);
    else
      cols<W, TA, NV - 1>(nv, mr, a, A, B, C);
  }
}

// nt < 2W columns past the tier's whole vectors: one vector of W if they fill it, then narrower
// vectors; the last 1-3 columns in a 4-float window that reaches back over columns already done
// (stored only in its last lanes). Every column thus runs in a vector lane with the same
// arithmetic, whatever the compiler makes of it (FMA contraction at -O3, none at -O1), so an
// element's bits do not depend on where its tile starts. Products under 4 columns run scalar.
template <int W, bool TA>
KUAI_KERNEL void tail(int nt, int mr, const Args& a, const float* A, const float* B, float* C) {
  if constexpr (W >= 4) {
    if (nt >= W) {
      rows<W, 1, TA, kMR>(mr, a, A, B, C);
      B += W;
      C += W;
      nt -= W;
    }
    tail<W / 2, TA>(nt, mr, a, A, B, C);
  } else if (nt > 0) {
    if (a.N >= 4)
      rows<4, 1, TA, kMR>(mr, a, A, B + nt - 4, C + nt - 4, 4 - nt);
    else
      tile_scalar<TA>(mr, nt, a.K, a.alpha, A, a.lda, B, a.ldb, a.beta, C, a.ldc);
  }
}

// Column panels of NV vectors (op(B)'s panel stays in L1 while every row tile passes over it),
// row tiles of MR inside each.
template <class T, bool TA>
KUAI_KERNEL void drive(const Args& a) {
  constexpr int W = T::kW, NC = T::kNV * T::kW;
  for (int64_t n0 = 0; n0 < a.N; n0 += NC) {
    const int64_t nn = std::min<int64_t>(NC, a.N - n0);
    const int nv = static_cast<int>(nn / W), nt = static_cast<int>(nn % W);
    for (int64_t m0 = 0; m0 < a.M; m0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, a.M - m0));
      const float* A = TA ? a.A + m0 : a.A + m0 * a.lda;
      float* C = a.C + m0 * a.ldc + n0;
      if (nv > 0) cols<W, TA, T::kNV>(nv, mr, a, A, a.B + n0, C);
      if (nt > 0) tail<W / 2, TA>(nt, mr, a, A, a.B + n0 + nv * W, C + nv * W);
    }
  }
}

template <class T>
KUAI_KERNEL void run(const Args& a) {
  if (a.ta)
    drive<T, true>(a);
  else
    drive<T, false>(a);
}

#if KUAI_HAVE_ISA_CLONES
KUAI_TARGET_AVX512 void run_avx512(const Args& a) { run<Avx512>(a); }
KUAI_TARGET_AVX2 void run_avx2(const Args& a) { run<Avx2>(a); }
#endif
void run_baseline(const Args& a) { run<Baseline>(a); }

typedef float f32x8 __attribute__((vector_size(32)));

// An 8 x 8 block: out[c] = column c of the rows r[0..7] (the unpack, shuffle, lane-swap network
// of the AVX transposes, written portably).
KUAI_KERNEL void transpose8(const f32x8 (&r)[8], f32x8 (&out)[8]) {
  f32x8 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int h = 0; h < 2; ++h)  // rows 0-3, then 4-7
    for (int i = 0; i < 2; ++i) {
      const f32x8 &a = t[4 * h + i], &b = t[4 * h + 2 + i];
      u[4 * h + 2 * i] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * h + 2 * i + 1] = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int c = 0; c < 4; ++c) {
    out[c] = __builtin_shufflevector(u[c], u[4 + c], 0, 1, 2, 3, 8, 9, 10, 11);
    out[4 + c] = __builtin_shufflevector(u[c], u[4 + c], 4, 5, 6, 7, 12, 13, 14, 15);
  }
}

KUAI_KERNEL void transpose_kernel(const float* src, int64_t lds, int64_t rows, int64_t cols,
                                  float* dst, int64_t ldd) {
  constexpr int64_t kB = 8;
  const int64_t rb = rows / kB * kB, cb = cols / kB * kB;
  for (int64_t r0 = 0; r0 < rb; r0 += kB)
    for (int64_t c0 = 0; c0 < cb; c0 += kB) {
      f32x8 in[8], out[8];
      for (int i = 0; i < 8; ++i) std::memcpy(&in[i], src + (r0 + i) * lds + c0, sizeof(f32x8));
      transpose8(in, out);
      for (int i = 0; i < 8; ++i) std::memcpy(dst + (c0 + i) * ldd + r0, &out[i], sizeof(f32x8));
    }
  // The edges: rows past the last whole block (all columns), columns past it (whole-block rows).
  for (int64_t r = rb; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  for (int64_t r = 0; r < rb; ++r)
    for (int64_t c = cb; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}
KUAI_CLONE(transpose_clone, transpose_kernel)

}  // namespace

void transpose_floats(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                      int64_t ldd) {
  transpose_clone(src, lds, rows, cols, dst, ldd);
}

int64_t small_gemm_scratch_floats(bool trans_b, int64_t N, int64_t K) {
  return trans_b ? N * K : 0;
}

void small_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                int64_t ldc, float* scratch) {
  if (M <= 0 || N <= 0) return;
  if (trans_b) {
    transpose_floats(B, ldb, N, K, scratch, N);
    B = scratch;
    ldb = N;
  }
  const Args a{trans_a, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc};
#if KUAI_HAVE_ISA_CLONES
  switch (clone_variant()) {
    case Isa::kAvx512:
      return run_avx512(a);
    case Isa::kAvx2:
      return run_avx2(a);
    default:
      break;
  }
#endif
  run_baseline(a);
}

}  // namespace kuai::cpu
