// Mixed-precision GEMM (bf16/f16/f32 storage, fp32 accumulation) for the CPU backend: the
// widen-to-fp32 path over cpu::gemm, the oneDNN low-precision matmul path with its own primitive
// cache, the automatic choice between them and the double-accumulated reference.
#include "kuai/backend/cpu/gemm_lowp.h"

#include <omp.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <vector>

#include "kuai/backend/cpu/gemm.h"
#include "kuai/backend/cpu/onednn_cache.h"

namespace kuai::cpu {
namespace {

std::atomic<LowpGemmPath> g_path{LowpGemmPath::kAuto};

// ---- kConvertFp32 ----

// Per-thread fp32 scratch for the widened operands and C, grown on demand and reused across
// calls, so steady-state steps allocate nothing. This first version widens whole operands before
// the product (one extra pass over A, B and a low-precision C, plus 4 bytes per element of
// scratch); converting panels inside the GEMM's blocking would avoid the scratch but needs a GEMM
// kernel of our own.
struct Scratch {
  std::vector<float> a, b, c;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Element `i` of a row-major (rows, cols) matrix with leading dimension `ld`, in bytes.
const void* element(const void* base, DType t, int64_t i) {
  return static_cast<const char*>(base) + i * dtype_size(t);
}
void* element(void* base, DType t, int64_t i) {
  return static_cast<char*>(base) + i * dtype_size(t);
}

// Copies the (rows, cols, ld) matrix `src` of type `st` into the (rows, cols, ld_dst) matrix `dst`
// of type `dt` through kuai::convert (round to nearest even when narrowing). Contiguous matrices
// are one call (convert parallelises large ones itself); strided ones are parallel over rows.
void convert_matrix(const void* src, DType st, int64_t ld_src, void* dst, DType dt, int64_t ld_dst,
                    int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  if (ld_src == cols && ld_dst == cols) {
    convert(src, st, dst, dt, rows * cols);
    return;
  }
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16) && !omp_in_parallel())
  for (int64_t r = 0; r < rows; ++r) {
    convert(element(src, st, r * ld_src), st, element(dst, dt, r * ld_dst), dt, cols);
  }
}

// op(X)'s storage widened to fp32: X itself when already fp32, else dense scratch. Sets *ld_out.
const float* widen(const void* x, DType t, int64_t rows, int64_t cols, int64_t ld,
                   std::vector<float>& buf, int64_t* ld_out) {
  if (t == DType::kF32) {
    *ld_out = ld;
    return static_cast<const float*>(x);
  }
  const size_t need = static_cast<size_t>(rows * cols);
  if (buf.size() < need) buf.resize(need);
  convert_matrix(x, t, ld, buf.data(), DType::kF32, cols, rows, cols);
  *ld_out = cols;
  return buf.data();
}

void gemm_convert_fp32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype,
                       int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc) {
  Scratch& s = scratch();
  int64_t lda32 = lda, ldb32 = ldb;
  // A is stored (M,K), or (K,M) when transposed; likewise B (K,N) or (N,K).
  const float* a32 = widen(A, a_dtype, trans_a ? K : M, trans_a ? M : K, lda, s.a, &lda32);
  const float* b32 = widen(B, b_dtype, trans_b ? N : K, trans_b ? K : N, ldb, s.b, &ldb32);
  if (c_dtype == DType::kF32) {
    gemm(trans_a, trans_b, M, N, K, alpha, a32, lda32, b32, ldb32, beta, static_cast<float*>(C),
         ldc);
    return;
  }
  const size_t need = static_cast<size_t>(M * N);
  if (s.c.size() < need) s.c.resize(need);
  if (beta != 0.0f) convert_matrix(C, c_dtype, ldc, s.c.data(), DType::kF32, N, M, N);
  gemm(trans_a, trans_b, M, N, K, alpha, a32, lda32, b32, ldb32, beta, s.c.data(), N);
  convert_matrix(s.c.data(), DType::kF32, N, C, c_dtype, ldc, M, N);
}

// ---- kOneDNN ----

dnnl::memory::data_type dnnl_type(DType t) {
  switch (t) {
    case DType::kBF16:
      return dnnl::memory::data_type::bf16;
    case DType::kF16:
      return dnnl::memory::data_type::f16;
    default:
      return dnnl::memory::data_type::f32;
  }
}

// Everything a low-precision oneDNN matmul primitive is specialised on (gemm.cpp's MatmulKey plus
// the three data types). alpha is an output scale and beta a sum post-op, fixed at creation.
struct LowpKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  DType a_type, b_type, c_type;
  float alpha, beta;
  int threads;
  bool operator==(const LowpKey&) const = default;
};

struct LowpKeyHash {
  size_t operator()(const LowpKey& key) const {
    size_t h = 0;
    auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    for (int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc}) {
      mix(std::hash<int64_t>{}(v));
    }
    mix(std::hash<float>{}(key.alpha));
    mix(std::hash<float>{}(key.beta));
    mix(static_cast<size_t>(key.threads) << 8 | static_cast<size_t>(key.a_type) << 6 |
        static_cast<size_t>(key.b_type) << 4 | static_cast<size_t>(key.c_type) << 2 |
        size_t{key.trans_a} << 1 | size_t{key.trans_b});
    return h;
  }
};

struct LowpMatmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a_md, b_md, c_md;
  std::string impl;
};

// A key oneDNN has no implementation for is cached as nullptr (see onednn_cache.h).
std::shared_ptr<const LowpMatmul> create_lowp_matmul(const LowpKey& key) {
  using dims = dnnl::memory::dims;
  dnnl::memory::desc a_md(dims{key.m, key.k}, dnnl_type(key.a_type),
                          key.trans_a ? dims{1, key.lda} : dims{key.lda, 1});
  dnnl::memory::desc b_md(dims{key.k, key.n}, dnnl_type(key.b_type),
                          key.trans_b ? dims{1, key.ldb} : dims{key.ldb, 1});
  dnnl::memory::desc c_md(dims{key.m, key.n}, dnnl_type(key.c_type), dims{key.ldc, 1});
  dnnl::primitive_attr attr;
  if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(key.beta);
    attr.set_post_ops(ops);
  }
  const int saved_threads = omp_get_max_threads();
  if (key.threads != saved_threads) omp_set_num_threads(key.threads);
  std::shared_ptr<const LowpMatmul> made;
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, onednn_engine());
    made = std::make_shared<LowpMatmul>(
        LowpMatmul{dnnl::matmul(pd), a_md, b_md, c_md, pd.impl_info_str()});
  } catch (const dnnl::error&) {
    made = nullptr;  // unimplemented combination (e.g. mixed bf16 x f16)
  }
  if (key.threads != saved_threads) omp_set_num_threads(saved_threads);
  return made;
}

std::shared_ptr<const LowpMatmul> cached_lowp_matmul(const LowpKey& key) {
  static OneDnnCache<LowpKey, LowpMatmul, LowpKeyHash> cache;
  return cache.get(key, create_lowp_matmul);
}

LowpKey lowp_key(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 DType a_dtype, int64_t lda, DType b_dtype, int64_t ldb, float beta, DType c_dtype,
                 int64_t ldc) {
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  return LowpKey{M,       N,       K,       lda,     ldb,   ldc,  trans_a,
                 trans_b, a_dtype, b_dtype, c_dtype, alpha, beta, threads};
}

void run_onednn(const LowpMatmul& mm, const void* A, const void* B, void* C) {
  const dnnl::engine& engine = onednn_engine();
  thread_local dnnl::stream stream(engine);
  dnnl::memory a(mm.a_md, engine, const_cast<void*>(A));
  dnnl::memory b(mm.b_md, engine, const_cast<void*>(B));
  dnnl::memory c(mm.c_md, engine, C);
  mm.primitive.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  stream.wait();
}

// ---- automatic choice ----

// kAuto: oneDNN's bf16 matmul can only beat widening to fp32 where the CPU multiplies bf16
// natively (AVX512-BF16 dot products, AMX tiles), running a JIT bf16 kernel at up to 2x (AVX512
// BF16) or far more (AMX) the fp32 rate while reading half the bytes; there kAuto uses it. Below
// avx512_core oneDNN 2.6 has no bf16 or f16 matmul at all (primitive creation fails, even the
// reference one), so every AVX2-only machine widens. Measured on the 2-core AVX2 EPYC
// (OMP_NUM_THREADS=2, bench/bench_gemm_lowp.cpp, median GFLOP/s of 3 repetitions, fwd y = x W^T,
// bf16 x and W):
//   shape (M,N,K)           fp32 gemm   widen, f32 out   widen, bf16 out   oneDNN bf16
//   tiny qkv  4096,768,256      153          123               96          unimplemented
//   tiny proj 4096,256,256      156           71               62          unimplemented
//   tiny fc   4096,1024,256     168          158              115          unimplemented
//   tiny fc_p 4096,256,1024     141           72               73          unimplemented
//   gpt2 qkv  1024,2304,768     165          141              129          unimplemented
//   gpt2 proj 1024,768,768      163          107              100          unimplemented
//   gpt2 fc   1024,3072,768     167          145              130          unimplemented
//   gpt2 fc_p 1024,768,3072    (167 best)    141              138          unimplemented
// Widening whole operands costs ~1 ns per element here (kuai::convert, bandwidth bound), which
// is what separates the middle columns from the fp32 one on the products with little reuse.
// The ISA is what oneDNN itself dispatches on.
LowpGemmPath measured_auto_path() {
  return cpu_has_native_bf16() ? LowpGemmPath::kOneDNN : LowpGemmPath::kConvertFp32;
}

bool valid_operand(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

bool cpu_has_native_bf16() {
  static const bool native = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (isa & bf16) == bf16;  // oneDNN's ISA values are nested bit masks; AMX includes bf16
  }();
  return native;
}

LowpGemmPath lowp_gemm_auto_path() {
  static const LowpGemmPath path = measured_auto_path();
  return path;
}

void set_lowp_gemm_path(LowpGemmPath path) { g_path.store(path, std::memory_order_relaxed); }

LowpGemmPath lowp_gemm_path() { return g_path.load(std::memory_order_relaxed); }

void gemm_lowp(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const void* A, DType a_dtype, int64_t lda, const void* B, DType b_dtype, int64_t ldb,
               float beta, void* C, DType c_dtype, int64_t ldc) {
  if (!valid_operand(a_dtype) || !valid_operand(b_dtype) || !valid_operand(c_dtype)) return;
  if (M <= 0 || N <= 0) return;
  LowpGemmPath path = lowp_gemm_path();
  if (path == LowpGemmPath::kAuto) path = lowp_gemm_auto_path();
  const bool all_f32 = a_dtype == DType::kF32 && b_dtype == DType::kF32 && c_dtype == DType::kF32;
  // Degenerate products (no multiply) and pure fp32 ones need no oneDNN low-precision primitive.
  if (path == LowpGemmPath::kOneDNN && K > 0 && alpha != 0.0f && !all_f32) {
    auto mm = cached_lowp_matmul(
        lowp_key(trans_a, trans_b, M, N, K, alpha, a_dtype, lda, b_dtype, ldb, beta, c_dtype, ldc));
    if (mm) {
      run_onednn(*mm, A, B, C);
      return;
    }
  }
  gemm_convert_fp32(trans_a, trans_b, M, N, K, alpha, A, a_dtype, lda, B, b_dtype, ldb, beta, C,
                    c_dtype, ldc);
}

std::string lowp_onednn_impl(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                             DType a_dtype, int64_t lda, DType b_dtype, int64_t ldb, DType c_dtype,
                             int64_t ldc) {
  auto mm = cached_lowp_matmul(
      lowp_key(trans_a, trans_b, M, N, K, 1.0f, a_dtype, lda, b_dtype, ldb, 0.0f, c_dtype, ldc));
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
