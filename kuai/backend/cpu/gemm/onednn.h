// oneDNN matmul primitives for the CPU GEMMs (gemm.cpp in fp32, gemm_lowp.cpp in bf16/f16): one
// key type with everything a primitive is specialised on, created once per key through the shared
// cache (onednn_cache.h) and run on a per-thread stream. Operands are row-major with leading
// dimensions and transpose flags exactly as cpu::gemm takes them.
#pragma once

#include <cstdint>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>

#include "kuai/core/dtype.h"

namespace kuai::cpu {

// alpha becomes an output scale and beta a sum post-op, both fixed at creation; `threads` is the
// team size the primitive partitions its work for (1 inside an OpenMP parallel region, where
// oneDNN runs sequentially).
struct OneDnnMatmulKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b;
  DType a_type, b_type, c_type;
  float alpha, beta;
  int threads;
  bool bias = false;  // a (1, N) fp32 bias added in the epilogue
  bool operator==(const OneDnnMatmulKey&) const = default;
};

// Created in oneDNN's *user* scratchpad mode: the primitive owns no working memory, and every
// execution brings its own (run_onednn_matmul takes it from the tracking allocator for the length
// of the call). In the default library mode a primitive owns one scratch buffer, so two threads
// executing the same cached primitive at once (gemm_batched over the batch, attention's per-head
// products inside parallel regions) overwrite each other's packed panels and accumulators.
struct OneDnnMatmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a_md, b_md, c_md, bias_md, scratch_md;
  size_t scratch_bytes = 0;
  std::string impl;  // oneDNN's implementation name ("brg:avx512_core_amx", "jit:gemm:any", ...)
  uint64_t id = 0;   // unique per created primitive: threads keep their memory objects by it
};

// The key for this product, with the calling thread's team size.
OneDnnMatmulKey onednn_matmul_key(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                  float alpha, DType a_type, int64_t lda, DType b_type, int64_t ldb,
                                  float beta, DType c_type, int64_t ldc);

// The primitive for `key`, created on first use; nullptr when oneDNN has no implementation for
// it (bf16/f16 below AVX512, mixed bf16 x f16, ...).
std::shared_ptr<const OneDnnMatmul> cached_onednn_matmul(const OneDnnMatmulKey& key);

// C = op(A) op(B) (+ bias), with the key's alpha and beta; pointers to elements of the key's types.
// Safe to call on one primitive from several threads at once: the scratchpad is per call.
void run_onednn_matmul(const OneDnnMatmul& mm, const void* A, const void* B, void* C,
                       const float* bias = nullptr);

}  // namespace kuai::cpu
