// oneDNN matmul primitives, cached per key (see onednn_matmul.h).
#include "kuai/backend/cpu/gemm/onednn.h"

#include <omp.h>

#include <atomic>
#include <functional>
#include <unordered_map>

#include "kuai/backend/cpu/gemm/onednn_cache.h"
#include "kuai/core/allocator.h"

namespace kuai::cpu {
namespace {

// Identities of created primitives (OneDnnMatmul::id), never reused.
std::atomic<uint64_t> g_next_id{1};

// Primitives a thread keeps memory objects for (run_onednn_matmul); beyond that it starts over.
constexpr size_t kMaxBoundPerThread = 1024;

struct KeyHash {
  size_t operator()(const OneDnnMatmulKey& key) const {
    size_t h = 0;
    auto mix = [&h](size_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
    for (int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc}) {
      mix(std::hash<int64_t>{}(v));
    }
    mix(std::hash<float>{}(key.alpha));
    mix(std::hash<float>{}(key.beta));
    mix(static_cast<size_t>(key.threads) << 9 | static_cast<size_t>(key.a_type) << 7 |
        static_cast<size_t>(key.b_type) << 5 | static_cast<size_t>(key.c_type) << 3 |
        size_t{key.bias} << 2 | size_t{key.trans_a} << 1 | size_t{key.trans_b});
    return h;
  }
};

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

std::shared_ptr<const OneDnnMatmul> create(const OneDnnMatmulKey& key) {
  using dims = dnnl::memory::dims;
  // Logical op(A) is (M,K): row-major strides {lda,1}, or {1,lda} when A is stored (K,M).
  dnnl::memory::desc a_md(dims{key.m, key.k}, dnnl_type(key.a_type),
                          key.trans_a ? dims{1, key.lda} : dims{key.lda, 1});
  dnnl::memory::desc b_md(dims{key.k, key.n}, dnnl_type(key.b_type),
                          key.trans_b ? dims{1, key.ldb} : dims{key.ldb, 1});
  dnnl::memory::desc c_md(dims{key.m, key.n}, dnnl_type(key.c_type), dims{key.ldc, 1});
  const dnnl::memory::desc bias_md(dims{1, key.n}, dnnl::memory::data_type::f32, dims{key.n, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // see OneDnnMatmul in the header
  if (key.alpha != 1.0f) attr.set_output_scales(0, {key.alpha});
  if (key.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(key.beta);
    attr.set_post_ops(ops);
  }
  // oneDNN sizes its work split by omp_get_max_threads() of the creating thread.
  const int saved_threads = omp_get_max_threads();
  if (key.threads != saved_threads) omp_set_num_threads(key.threads);
  std::shared_ptr<const OneDnnMatmul> made;
  try {
    dnnl::matmul::primitive_desc pd(key.bias ? dnnl::matmul::desc(a_md, b_md, bias_md, c_md)
                                             : dnnl::matmul::desc(a_md, b_md, c_md),
                                    attr, onednn_engine());
    const dnnl::memory::desc scratch_md = pd.scratchpad_desc();
    made = std::make_shared<OneDnnMatmul>(
        OneDnnMatmul{dnnl::matmul(pd), a_md, b_md, c_md, bias_md, scratch_md, scratch_md.get_size(),
                     pd.impl_info_str(), g_next_id.fetch_add(1, std::memory_order_relaxed)});
  } catch (const dnnl::error&) {
    made = nullptr;  // no implementation for this combination
  }
  if (key.threads != saved_threads) omp_set_num_threads(saved_threads);
  return made;
}

}  // namespace

OneDnnMatmulKey onednn_matmul_key(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                                  float alpha, DType a_type, int64_t lda, DType b_type, int64_t ldb,
                                  float beta, DType c_type, int64_t ldc) {
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  return OneDnnMatmulKey{M,       N,      K,      lda,    ldb,   ldc,  trans_a,
                         trans_b, a_type, b_type, c_type, alpha, beta, threads};
}

std::shared_ptr<const OneDnnMatmul> cached_onednn_matmul(const OneDnnMatmulKey& key) {
  static OneDnnCache<OneDnnMatmulKey, OneDnnMatmul, KeyHash> cache;
  // Each thread first asks its own copy of the entries it used, without the shared cache's lock.
  thread_local std::unordered_map<OneDnnMatmulKey, std::shared_ptr<const OneDnnMatmul>, KeyHash>
      local;
  if (auto it = local.find(key); it != local.end()) return it->second;
  std::shared_ptr<const OneDnnMatmul> found = cache.get(key, create);
  if (local.size() >= kMaxBoundPerThread) local.clear();
  local.emplace(key, found);
  return found;
}

void run_onednn_matmul(const OneDnnMatmul& mm, const void* A, const void* B, void* C,
                       const float* bias) {
  // The calling thread's memory objects for this primitive, made on its first execution here and
  // pointed at the operands of each call: a small product (attention's per-head tiles run
  // thousands a step) then pays no allocation for them, and the arguments go to oneDNN's C API as
  // an array on the stack.
  struct Bound {
    dnnl::memory a, b, c, bias, scratch;
  };
  thread_local std::unordered_map<uint64_t, Bound> bound;
  const dnnl::engine& engine = onednn_engine();
  thread_local dnnl::stream stream(engine);
  auto it = bound.find(mm.id);
  if (it == bound.end()) {
    if (bound.size() >= kMaxBoundPerThread) bound.clear();
    Bound made{
        dnnl::memory(mm.a_md, engine, nullptr), dnnl::memory(mm.b_md, engine, nullptr),
        dnnl::memory(mm.c_md, engine, nullptr), dnnl::memory(mm.bias_md, engine, nullptr),
        mm.scratch_bytes > 0 ? dnnl::memory(mm.scratch_md, engine, nullptr) : dnnl::memory()};
    it = bound.emplace(mm.id, std::move(made)).first;
  }
  Bound& m = it->second;
  m.a.set_data_handle(const_cast<void*>(A));
  m.b.set_data_handle(const_cast<void*>(B));
  m.c.set_data_handle(C);
  dnnl_exec_arg_t args[5] = {
      {DNNL_ARG_SRC, m.a.get()}, {DNNL_ARG_WEIGHTS, m.b.get()}, {DNNL_ARG_DST, m.c.get()}};
  int nargs = 3;
  if (bias != nullptr) {
    m.bias.set_data_handle(const_cast<float*>(bias));
    args[nargs++] = {DNNL_ARG_BIAS, m.bias.get()};
  }
  // This execution's own scratchpad (64-byte aligned, a cached block after the first step).
  ScratchBytes scratch(mm.scratch_bytes);
  if (mm.scratch_bytes > 0) {
    m.scratch.set_data_handle(scratch.data());
    args[nargs++] = {DNNL_ARG_SCRATCHPAD, m.scratch.get()};
  }
  dnnl::error::wrap_c_api(dnnl_primitive_execute(mm.primitive.get(), stream.get(), nargs, args),
                          "oneDNN: matmul execution failed");
  dnnl::error::wrap_c_api(dnnl_stream_wait(stream.get()), "oneDNN: stream wait failed");
}

}  // namespace kuai::cpu
