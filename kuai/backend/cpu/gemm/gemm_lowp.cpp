// Mixed-precision GEMM (bf16/f16/f32 storage, fp32 accumulation) for the CPU backend: the
// blocked widen-to-fp32 path over cpu::gemm (scratch bounded by a panel budget, from the tracking
// allocator), the oneDNN low-precision matmul path with its own primitive
// cache, the automatic choice between them and the double-accumulated reference.
#include "kuai/backend/cpu/gemm/gemm_lowp.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <functional>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <vector>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/libraries.h"
#include "kuai/backend/cpu/gemm/onednn.h"
#include "kuai/backend/cpu/gemm/packed.h"
#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/core/allocator.h"

namespace kuai::cpu {
namespace {

std::atomic<LowpGemmPath> g_path{LowpGemmPath::kAuto};

// ---- kConvertFp32 ----

// The product is blocked so that no widened panel holds more than the budget: op(A) in (mb, kb)
// panels, op(B) in (kb, nb) panels and, for a low-precision C, C in (mb, nb) fp32 blocks. An fp32
// operand is never copied (the panel is a pointer into it); an fp32 C is accumulated in place.
// Scratch is therefore at most three panels (3 x 16 MiB by default), whatever the operand sizes,
// comes from the tracking allocator and is returned before gemm_lowp returns.
constexpr int64_t kDefaultPanelFloats = int64_t{1} << 22;  // 16 MiB of fp32 per panel
constexpr int64_t kMaxKBlock = 4096;  // long K blocks keep each inner cpu::gemm efficient
constexpr int64_t kMinMNBlock = 256;  // M, N blocks at least this long when the budget allows
constexpr int64_t kBlockAlign = 16;   // block lengths rounded up to 64 bytes of fp32 if they fit

std::atomic<int64_t> g_panel_budget{0};  // 0: kDefaultPanelFloats

int64_t panel_budget() {
  const int64_t b = g_panel_budget.load(std::memory_order_relaxed);
  return b > 0 ? b : kDefaultPanelFloats;
}

// Element `i` of a row-major (rows, cols) matrix with leading dimension `ld`, in bytes.
const void* element(const void* base, DType t, int64_t i) {
  return static_cast<const char*>(base) + i * dtype_size(t);
}
void* element(void* base, DType t, int64_t i) {
  return static_cast<char*>(base) + i * dtype_size(t);
}

// Copies the (rows, cols, ld_src) matrix `src` of type `st` into the (rows, cols, ld_dst) matrix
// `dst` of type `dt` (round to nearest even when narrowing), in parallel over pieces of rows of at
// most kPiece elements (so a single long row is split too); each piece is one convert_serial.
void convert_matrix(const void* src, DType st, int64_t ld_src, void* dst, DType dt, int64_t ld_dst,
                    int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  if (ld_src == cols && ld_dst == cols) {  // dense: one long row
    cols *= rows;
    rows = 1;
  }
  constexpr int64_t kPiece = 1 << 14;
  const int64_t pieces_per_row = (cols + kPiece - 1) / kPiece;
  const int64_t pieces = rows * pieces_per_row;
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16) && !omp_in_parallel())
  for (int64_t t = 0; t < pieces; ++t) {
    const int64_t r = t / pieces_per_row, c = (t % pieces_per_row) * kPiece;
    convert_serial(element(src, st, r * ld_src + c), st, element(dst, dt, r * ld_dst + c), dt,
                   std::min(kPiece, cols - c));
  }
}

// Length of the blocks `extent` is cut into: at most `cap`, as even as possible (no short last
// block), rounded up to kBlockAlign when that still fits.
int64_t block_length(int64_t extent, int64_t cap) {
  cap = std::max<int64_t>(cap, 1);
  if (extent <= cap) return std::max<int64_t>(extent, 1);
  const int64_t blocks = (extent + cap - 1) / cap;
  const int64_t even = (extent + blocks - 1) / blocks;
  const int64_t aligned = (even + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
  return aligned <= cap ? aligned : even;
}

struct Blocking {
  int64_t mb, nb, kb;
};

// Block sizes for a product; a function of the shape, the operand types (only widened operands
// constrain) and the budget only, never of the thread count, so results are reproducible.
Blocking choose_blocking(int64_t M, int64_t N, int64_t K, bool widen_a, bool widen_b, bool widen_c,
                         int64_t budget) {
  int64_t side = static_cast<int64_t>(std::sqrt(static_cast<double>(budget)));  // floor(sqrt)
  while (side * side > budget) --side;
  while ((side + 1) * (side + 1) <= budget) ++side;
  const int64_t min_mn = std::min(kMinMNBlock, side);
  // K first: as long as possible while leaving room for min_mn rows (columns) of a panel.
  int64_t kcap = widen_a || widen_b ? kMaxKBlock : K;  // only C widened: K need not be cut
  if (widen_a) kcap = std::min(kcap, budget / std::min(M, min_mn));
  if (widen_b) kcap = std::min(kcap, budget / std::min(N, min_mn));
  const int64_t kb = block_length(K, kcap);
  int64_t mcap = widen_a ? budget / kb : M, ncap = widen_b ? budget / kb : N;
  mcap = std::min(std::max<int64_t>(mcap, 1), M);
  ncap = std::min(std::max<int64_t>(ncap, 1), N);
  // The fp32 C block: keep a side that is at most sqrt(budget) whole and cut the other; when both
  // are longer, square blocks.
  if (widen_c && mcap * ncap > budget) {
    if (mcap <= side) {
      ncap = budget / mcap;
    } else if (ncap <= side) {
      mcap = budget / ncap;
    } else {
      mcap = ncap = side;
    }
  }
  return Blocking{block_length(M, mcap), block_length(N, ncap), kb};
}

// One panel of op(X): op rows [r0, r0 + rows), op columns [c0, c0 + cols) of the matrix stored
// row-major with leading dimension `ld`, transposed when `trans`. Returns the storage of the panel
// in fp32 (a pointer into X when X is fp32, else widened into `scratch`, densely) and its leading
// dimension; the panel keeps the orientation of X, so cpu::gemm gets the same transpose flag.
const float* panel(const void* x, DType t, int64_t ld, bool trans, int64_t r0, int64_t c0,
                   int64_t rows, int64_t cols, float* scratch, int64_t* ld_out) {
  const int64_t srow = trans ? c0 : r0, scol = trans ? r0 : c0;
  const int64_t srows = trans ? cols : rows, scols = trans ? rows : cols;
  if (rows <= 0 || cols <= 0) {  // nothing is read (K == 0): any pointer will do
    *ld_out = std::max<int64_t>(t == DType::kF32 ? ld : scols, 1);
    return t == DType::kF32 ? static_cast<const float*>(x) : scratch;
  }
  const void* first = element(x, t, srow * ld + scol);
  if (t == DType::kF32) {
    *ld_out = ld;
    return static_cast<const float*>(first);
  }
  convert_matrix(first, t, ld, scratch, DType::kF32, scols, srows, scols);
  *ld_out = scols;
  return scratch;
}

// The widened panels of one product. Called from inside a parallel loop (attention's per-head
// products), a worker thread takes them from three per-thread buffers kept between calls (up to
// 1 MiB each, as the packed kernels' per-thread packing buffers): no allocator round trip per
// head, and nothing a compiled step would have to allocate on a worker. Otherwise they are
// tracked scratch from the calling thread.
constexpr int64_t kLocalWidenFloats = int64_t{1} << 18;

class WidenBuffer {
 public:
  WidenBuffer(int64_t count, int slot) {
    if (count > 0 && count <= kLocalWidenFloats && omp_in_parallel()) {
      thread_local std::vector<float> local[3];
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

// bias (N floats, fp32) is added on the first K block through gemm_bias (alpha 1, beta 0 only),
// so a low-precision C is still rounded once.
void gemm_convert_fp32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype,
                       int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc,
                       const float* bias = nullptr) {
  const bool widen_a = a_dtype != DType::kF32, widen_b = b_dtype != DType::kF32;
  const bool widen_c = c_dtype != DType::kF32;
  const Blocking blk = choose_blocking(M, N, K, widen_a, widen_b, widen_c, panel_budget());
  const int64_t kb = std::min(blk.kb, K);  // 0 when K == 0: one empty K block
  WidenBuffer a_buf(widen_a ? std::min(blk.mb, M) * kb : 0, 0);
  WidenBuffer b_buf(widen_b ? kb * std::min(blk.nb, N) : 0, 1);
  WidenBuffer c_buf(widen_c ? std::min(blk.mb, M) * std::min(blk.nb, N) : 0, 2);
  // The panels last widened, so a panel that does not change between consecutive products (one
  // K block, or one M or N block) is widened once.
  int64_t a_at[2] = {-1, -1}, b_at[2] = {-1, -1};
  const float* a32 = nullptr;
  const float* b32 = nullptr;
  int64_t lda32 = 0, ldb32 = 0;
  for (int64_t i0 = 0; i0 < M; i0 += blk.mb) {
    const int64_t mb = std::min(blk.mb, M - i0);
    for (int64_t j0 = 0; j0 < N; j0 += blk.nb) {
      const int64_t nb = std::min(blk.nb, N - j0);
      // The fp32 C block accumulated into: C itself, or the widened block of a low-precision C
      // (read only when beta != 0; beta == 0 ignores its contents, NaN garbage included).
      float* c32 = widen_c ? c_buf.data() : static_cast<float*>(C) + i0 * ldc + j0;
      const int64_t ldc32 = widen_c ? nb : ldc;
      if (widen_c && beta != 0.0f) {
        convert_matrix(element(C, c_dtype, i0 * ldc + j0), c_dtype, ldc, c32, DType::kF32, nb, mb,
                       nb);
      }
      int64_t p0 = 0;
      do {
        const int64_t kp = std::min(kb, K - p0);
        if (a_at[0] != i0 || a_at[1] != p0) {
          a32 = panel(A, a_dtype, lda, trans_a, i0, p0, mb, kp, a_buf.data(), &lda32);
          a_at[0] = i0;
          a_at[1] = p0;
        }
        if (b_at[0] != p0 || b_at[1] != j0) {
          b32 = panel(B, b_dtype, ldb, trans_b, p0, j0, kp, nb, b_buf.data(), &ldb32);
          b_at[0] = p0;
          b_at[1] = j0;
        }
        // beta on the first K block only; the later ones accumulate. Partial sums stay fp32.
        if (bias != nullptr && p0 == 0)
          gemm_bias(trans_a, trans_b, mb, nb, kp, a32, lda32, b32, ldb32, bias + j0, c32, ldc32);
        else
          gemm(trans_a, trans_b, mb, nb, kp, alpha, a32, lda32, b32, ldb32, p0 == 0 ? beta : 1.0f,
               c32, ldc32);
        p0 += kb;
      } while (p0 < K);
      if (widen_c) {
        convert_matrix(c32, DType::kF32, nb, element(C, c_dtype, i0 * ldc + j0), c_dtype, ldc, mb,
                       nb);
      }
    }
  }
}

// ---- kOneDNN ----

// ---- automatic choice ----

// The default path where no measurement decides (router.h: mostly the per-thread products of
// attention heads and blocks inside parallel regions; also small products and tuning off):
// - amx: oneDNN's bf16 matmul on AMX tiles, several times the fp32 rate.
// - avx2 up to avx512_bf16: the packed GEMM (packed.h: operands widened while packed, C rounded
//   in registers), which needs no scratch copy per call. On an Emerald Rapids VM without AMX
//   (avx512_bf16), bf16 training of the tiny model spent 495-520 ms in attention per 5 steps
//   with it, 540-550 with oneDNN's bf16 matmul (AVX512-BF16 dot products: 81 GFLOP/s on one
//   thread against 128-145 for fp32 there) and 670 widening (which wins large top-level
//   products there, 135-139 GFLOP/s: the router measures those). oneDNN 2.6 has no bf16 matmul
//   below avx512.
// - baseline: widening.
LowpGemmPath default_auto_path() {
  if (isa() >= Isa::kAmx && cpu_has_native_bf16()) return LowpGemmPath::kOneDNN;
  return packed_gemm_available() ? LowpGemmPath::kPacked : LowpGemmPath::kConvertFp32;
}

bool valid_operand(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

bool cpu_has_native_bf16() {
  static const bool native = [] {
    configure_gemm_libraries();  // oneDNN's max ISA first
    const auto effective = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    // oneDNN's ISA values are nested bit masks; AMX includes bf16.
    return isa() >= Isa::kAvx512Bf16 && (effective & bf16) == bf16;
  }();
  return native;
}

LowpGemmPath lowp_gemm_auto_path() {
  static const LowpGemmPath path = default_auto_path();
  return path;
}

void set_lowp_gemm_panel_budget(int64_t floats) {
  g_panel_budget.store(floats > 0 ? floats : 0, std::memory_order_relaxed);
}

int64_t lowp_gemm_panel_budget() { return panel_budget(); }

void set_lowp_gemm_path(LowpGemmPath path) { g_path.store(path, std::memory_order_relaxed); }

LowpGemmPath lowp_gemm_path() { return g_path.load(std::memory_order_relaxed); }

namespace {

// The paths that can run a product here, in a fixed order, and the index of the default one.
struct LowpCandidates {
  std::vector<GemmCandidate> list;
  std::vector<LowpGemmPath> paths;
  size_t fallback = 0;
};

LowpCandidates lowp_candidates(bool onednn_ok, std::function<void()> onednn,
                               std::function<void()> packed, std::function<void()> widen) {
  LowpCandidates c;
  if (onednn_ok) {
    c.list.push_back({"onednn", std::move(onednn)});
    c.paths.push_back(LowpGemmPath::kOneDNN);
  }
  if (packed_gemm_available()) {
    c.list.push_back({"packed", std::move(packed)});
    c.paths.push_back(LowpGemmPath::kPacked);
  }
  c.list.push_back({"widen", std::move(widen)});
  c.paths.push_back(LowpGemmPath::kConvertFp32);
  const LowpGemmPath def = lowp_gemm_auto_path();
  for (size_t i = 0; i < c.paths.size(); ++i)
    if (c.paths[i] == def) c.fallback = i;
  return c;
}

}  // namespace

void gemm_lowp(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype, int64_t ldb,
               float beta, void* C, DType c_dtype, int64_t ldc) {
  if (!valid_operand(a_dtype) || !valid_operand(b_dtype) || !valid_operand(c_dtype)) return;
  if (M <= 0 || N <= 0) return;
  const bool all_f32 = a_dtype == DType::kF32 && b_dtype == DType::kF32 && c_dtype == DType::kF32;
  // Degenerate products (no multiply) and pure fp32 ones need no oneDNN low-precision primitive.
  std::shared_ptr<const OneDnnMatmul> mm;
  if (K > 0 && alpha != 0.0f && !all_f32) {
    mm = cached_onednn_matmul(onednn_matmul_key(trans_a, trans_b, M, N, K, alpha, a_dtype, lda,
                                                b_dtype, ldb, beta, c_dtype, ldc));
  }
  auto onednn = [&] { run_onednn_matmul(*mm, A, B, C); };
  auto packed = [&] {
    gemm_packed(trans_a, trans_b, M, N, K, alpha, A, a_dtype, lda, B, b_dtype, ldb, beta, C,
                c_dtype, ldc);
  };
  auto widen = [&] {
    gemm_convert_fp32(trans_a, trans_b, M, N, K, alpha, A, a_dtype, lda, B, b_dtype, ldb, beta, C,
                      c_dtype, ldc);
  };
  LowpGemmPath path = lowp_gemm_path();
  if (path == LowpGemmPath::kAuto) {
    const LowpCandidates c = lowp_candidates(mm != nullptr, onednn, packed, widen);
    MatrixSnapshot snapshot(beta != 0.0f ? C : nullptr, M, N, ldc, dtype_size(c_dtype));
    path = c.paths[route({"lowp", trans_a, trans_b, M, N, K, 1, a_dtype, b_dtype, c_dtype}, c.list,
                         c.fallback, snapshot.save_fn(), snapshot.restore_fn())];
  }
  const GemmShape shape{"lowp", trans_a, trans_b, M, N, K, 1, a_dtype, b_dtype, c_dtype};
  if (path == LowpGemmPath::kPacked && packed_gemm_available())
    return run_profiled(shape, "packed", packed);
  if (path == LowpGemmPath::kOneDNN && mm) return run_profiled(shape, "onednn", onednn);
  run_profiled(shape, "widen", widen);  // kConvertFp32, and kOneDNN where oneDNN cannot build it
}

void gemm_lowp_bias(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
                    DType a_dtype, int64_t lda, const void* B, DType b_dtype, int64_t ldb,
                    const void* bias, DType bias_dtype, void* C, DType c_dtype, int64_t ldc) {
  if (!valid_operand(a_dtype) || !valid_operand(b_dtype) || !valid_operand(c_dtype) ||
      !valid_operand(bias_dtype))
    return;
  if (M <= 0 || N <= 0) return;
  ScratchFloats bias32(N);
  convert_serial(bias, bias_dtype, bias32.data(), DType::kF32, N);
  const bool all_f32 = a_dtype == DType::kF32 && b_dtype == DType::kF32 && c_dtype == DType::kF32;
  // oneDNN: C pre-filled with the bias rows, then C += A B (oneDNN reads C once, rounds once).
  std::shared_ptr<const OneDnnMatmul> mm;
  if (K > 0 && !all_f32) {
    mm = cached_onednn_matmul(onednn_matmul_key(trans_a, trans_b, M, N, K, 1.0f, a_dtype, lda,
                                                b_dtype, ldb, 1.0f, c_dtype, ldc));
  }
  auto onednn = [&] {
    const int64_t es = dtype_size(c_dtype);
#pragma omp parallel for schedule(static) if (M * N > (1 << 16) && !omp_in_parallel())
    for (int64_t r = 0; r < M; ++r)
      convert_serial(bias, bias_dtype, static_cast<char*>(C) + r * ldc * es, c_dtype, N);
    run_onednn_matmul(*mm, A, B, C);
  };
  auto packed = [&] {
    gemm_packed(trans_a, trans_b, M, N, K, 1.0f, A, a_dtype, lda, B, b_dtype, ldb, 0.0f, C, c_dtype,
                ldc, bias32.data());
  };
  auto widen = [&] {
    gemm_convert_fp32(trans_a, trans_b, M, N, K, 1.0f, A, a_dtype, lda, B, b_dtype, ldb, 0.0f, C,
                      c_dtype, ldc, bias32.data());
  };
  LowpGemmPath path = lowp_gemm_path();
  if (path == LowpGemmPath::kAuto) {
    const LowpCandidates c = lowp_candidates(mm != nullptr, onednn, packed, widen);
    path = c.paths[route({"lowp_bias", trans_a, trans_b, M, N, K, 1, a_dtype, b_dtype, c_dtype},
                         c.list, c.fallback)];
  }
  const GemmShape shape{"lowp_bias", trans_a, trans_b, M, N, K, 1, a_dtype, b_dtype, c_dtype};
  if (path == LowpGemmPath::kPacked && packed_gemm_available())
    return run_profiled(shape, "packed", packed);
  if (path == LowpGemmPath::kOneDNN && mm) return run_profiled(shape, "onednn", onednn);
  run_profiled(shape, "widen", widen);
}

namespace {
// -1: the tier decides; 0 / 1: forced by set_lowp_rounds_a.
std::atomic<int> g_round_a{-1};
}  // namespace

bool lowp_rounds_a(DType b_dtype) {
  if (b_dtype != DType::kBF16) return false;
  const int forced = g_round_a.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  return isa() >= Isa::kAmx && cpu_has_native_bf16();
}

void set_lowp_rounds_a(bool on) { g_round_a.store(on ? 1 : 0, std::memory_order_relaxed); }
void reset_lowp_rounds_a() { g_round_a.store(-1, std::memory_order_relaxed); }

void gemm_lowp_round_a(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t lda, const void* B, DType b_dtype, int64_t ldb,
                       float beta, void* C, DType c_dtype, int64_t ldc) {
  if (!lowp_rounds_a(b_dtype) || M <= 0 || N <= 0 || K <= 0) {
    gemm_lowp(trans_a, trans_b, M, N, K, alpha, A, DType::kF32, lda, B, b_dtype, ldb, beta, C,
              c_dtype, ldc);
    return;
  }
  // op(A) is (M, K): stored (M, K) rows, or (K, M) rows when transposed; copied densely.
  const int64_t rows = trans_a ? K : M, cols = trans_a ? M : K;
  ScratchBytes a16(static_cast<size_t>(rows * cols) * sizeof(uint16_t));
  convert_matrix(A, DType::kF32, lda, a16.data(), DType::kBF16, cols, rows, cols);
  gemm_lowp(trans_a, trans_b, M, N, K, alpha, a16.data(), DType::kBF16, cols, B, b_dtype, ldb, beta,
            C, c_dtype, ldc);
}

std::string lowp_onednn_impl(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             DType a_dtype, int64_t lda, DType b_dtype, int64_t ldb, DType c_dtype,
                             int64_t ldc) {
  auto mm = cached_onednn_matmul(onednn_matmul_key(trans_a, trans_b, M, N, K, 1.0f, a_dtype, lda,
                                                   b_dtype, ldb, 0.0f, c_dtype, ldc));
  return mm ? mm->impl : std::string();
}

void gemm_lowp_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype,
                         int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc) {
  auto load = [](const void* base, DType t, int64_t i) -> double {
    float v;
    convert(element(base, t, i), t, &v, DType::kF32, 1);
    return v;
  };
  // Widen op(A) (M,K) and op(B) (K,N) to dense doubles once; the loads are exact.
  std::vector<double> a(static_cast<size_t>(M * K)), b(static_cast<size_t>(K * N));
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t p = 0; p < K; ++p) {
      a[i * K + p] = load(A, a_dtype, trans_a ? p * lda + i : i * lda + p);
    }
  }
  for (int64_t p = 0; p < K; ++p) {
    for (int64_t j = 0; j < N; ++j) {
      b[p * N + j] = load(B, b_dtype, trans_b ? j * ldb + p : p * ldb + j);
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t p = 0; p < K; ++p) acc += a[i * K + p] * b[p * N + j];
      const int64_t c_index = i * ldc + j;
      const double prior =
          beta == 0.0f ? 0.0 : static_cast<double>(beta) * load(C, c_dtype, c_index);
      const float result = static_cast<float>(static_cast<double>(alpha) * acc + prior);
      convert(&result, DType::kF32, element(C, c_dtype, c_index), c_dtype, 1);
    }
  }
}

}  // namespace kuai::cpu
