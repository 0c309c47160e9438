// Micro-benchmarks for kuai::cpu::gemm_lowp: forward linear-layer products y = x W^T of the tiny
// GPT (4096 tokens, d_model 256) and GPT-2 124M (1024 tokens), and the three products of GPT-2's
// tied lm_head (logits = x Wte^T, dX = dlogits Wte, dWte = dlogits^T x), with bf16 operands, in
// GFLOP/s, for the fp32 gemm on fp32 copies (the ceiling), the widen-to-fp32 path and oneDNN's
// bf16 matmul; `scratch_MiB` is the widening path's scratch as the tracking allocator saw it
// (peak during one call). The kAuto choice in kuai/backend/cpu/gemm_lowp.cpp follows from these
// numbers. Run with OMP_NUM_THREADS=2:
//   OMP_NUM_THREADS=2 build/kuai_bench_ops --benchmark_filter=BM_GemmLowp
//     --benchmark_repetitions=3 --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/core/allocator.h"
#include "kuai/core/dtype.h"

namespace {

using kuai::DType;
using kuai::cpu::LowpGemmPath;

// Values in [-1, 1) from a 32-bit LCG.
std::vector<float> random_floats(int64_t size, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(size));
  uint32_t state = seed * 2654435761u + 1u;
  for (float& x : v) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) * (2.0f / 16777216.0f) - 1.0f;
  }
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  kuai::convert(v.data(), DType::kF32, out.data(), DType::kBF16, static_cast<int64_t>(v.size()));
  return out;
}

enum class Variant { kFp32, kConvert, kOneDNN, kPacked };

const char* variant_name(Variant v) {
  return v == Variant::kFp32      ? "fp32_gemm"
         : v == Variant::kConvert ? "convert_fp32"
         : v == Variant::kPacked  ? "packed"
                                  : "onednn";
}

// C(M,N) = op(A)(M,K) @ op(B)(K,N), A stored (M,K) or (K,M) when trans_a, B stored (K,N) or
// (N,K) when trans_b, all dense. kFp32 multiplies fp32 copies with cpu::gemm (automatic backend);
// the others bf16 operands with gemm_lowp on a forced path, into an fp32 (`c_type` kF32) or bf16
// output.
void bench_lowp(benchmark::State& state, Variant variant, bool trans_a, bool trans_b, int64_t M,
                int64_t N, int64_t K, DType c_type) {
  const int64_t lda = trans_a ? M : K, ldb = trans_b ? K : N;
  std::vector<float> a, b;
  std::vector<uint16_t> a16, b16;
  if (variant == Variant::kFp32) {
    a = random_floats(M * K, 1);
    b = random_floats(K * N, 2);
  } else {  // only the bf16 copies: the lm_head operands are hundreds of MB in fp32
    a16 = to_bf16(random_floats(M * K, 1));
    b16 = to_bf16(random_floats(K * N, 2));
  }
  std::vector<float> y;
  std::vector<uint16_t> y16;
  if (c_type == DType::kF32) {
    y.resize(static_cast<size_t>(M * N));
  } else {
    y16.resize(static_cast<size_t>(M * N));
  }
  void* out = c_type == DType::kF32 ? static_cast<void*>(y.data()) : y16.data();
  kuai::cpu::set_lowp_gemm_path(variant == Variant::kOneDNN   ? LowpGemmPath::kOneDNN
                                : variant == Variant::kPacked ? LowpGemmPath::kPacked
                                                              : LowpGemmPath::kConvertFp32);
  if (variant == Variant::kOneDNN) {
    // Without a oneDNN primitive gemm_lowp would silently widen; report that instead of timing it.
    const std::string impl = kuai::cpu::lowp_onednn_impl(trans_a, trans_b, M, N, K, DType::kBF16,
                                                         lda, DType::kBF16, ldb, c_type, N);
    if (impl.empty()) {
      state.SkipWithError("oneDNN has no bf16 matmul on this CPU");
      return;
    }
    state.SetLabel(impl);
  }
  auto run = [&] {
    if (variant == Variant::kFp32) {
      kuai::cpu::gemm(trans_a, trans_b, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, y.data(),
                      N);
    } else {
      kuai::cpu::gemm_lowp(trans_a, trans_b, M, N, K, 1.0f, a16.data(), DType::kBF16, lda,
                           b16.data(), DType::kBF16, ldb, 0.0f, out, c_type, N);
    }
  };
  // Scratch of one call as the tracking allocator sees it (and a warm-up).
  kuai::Allocator& alloc = kuai::Allocator::get();
  const int64_t before = alloc.stats().current;
  alloc.reset_peak();
  run();
  const double scratch_mib = static_cast<double>(alloc.stats().peak - before) / (1 << 20);
  double best = 1e30;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    run();
    benchmark::ClobberMemory();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  kuai::cpu::set_lowp_gemm_path(LowpGemmPath::kAuto);
  const double flops =
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  state.counters["GFLOPS"] = benchmark::Counter(
      flops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["GFLOPS_best"] = flops * 1e-9 / best;
  state.counters["scratch_MiB"] = scratch_mib;
}

struct Product {
  const char* name;
  int64_t m, n, k;
  bool trans_a, trans_b;
};

// Linear layers y(rows, out) = x(rows, in) W(out, in)^T are NT products (M, N, K) = (rows, out,
// in); GPT-2's lm_head ties W = Wte (50257, 768) and runs all three orientations.
const Product kProducts[] = {
    {"tiny/qkv", 4096, 768, 256, false, true},
    {"tiny/proj", 4096, 256, 256, false, true},
    {"tiny/fc", 4096, 1024, 256, false, true},
    {"tiny/fc_proj", 4096, 256, 1024, false, true},
    {"gpt2/qkv", 1024, 2304, 768, false, true},
    {"gpt2/proj", 1024, 768, 768, false, true},
    {"gpt2/fc", 1024, 3072, 768, false, true},
    {"gpt2/fc_proj", 1024, 768, 3072, false, true},
    {"tiny/fc_dX", 4096, 256, 1024, false, false},  // dX = dY W
    {"tiny/fc_dW", 1024, 256, 4096, true, false},   // dW = dY^T X
    {"gpt2/fc_dX", 1024, 768, 3072, false, false},
    {"gpt2/fc_dW", 3072, 768, 1024, true, false},
    {"gpt2/lm_head", 1024, 50257, 768, false, true},      // logits = x Wte^T
    {"gpt2/lm_head_dX", 1024, 768, 50257, false, false},  // dX = dlogits Wte
    {"gpt2/lm_head_dW", 50257, 768, 1024, true, false},   // dWte = dlogits^T x
};

const bool kRegistered = [] {
  for (const Product& p : kProducts) {
    for (Variant v : {Variant::kFp32, Variant::kConvert, Variant::kPacked, Variant::kOneDNN}) {
      for (DType c_type : {DType::kF32, DType::kBF16}) {
        if (v == Variant::kFp32 && c_type != DType::kF32) continue;
        const std::string name = std::string("BM_GemmLowp/") + p.name + "/" + variant_name(v) +
                                 (c_type == DType::kF32 ? "/out_f32" : "/out_bf16");
        benchmark::RegisterBenchmark(name.c_str(), bench_lowp, v, p.trans_a, p.trans_b, p.m, p.n,
                                     p.k, c_type)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  return true;
}();

}  // namespace
