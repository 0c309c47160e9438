// Micro-benchmarks for kuai::cpu::gemm_lowp: forward linear-layer products y = x W^T of the tiny
// GPT (4096 tokens, d_model 256) and GPT-2 124M (1024 tokens) with bf16 x and W, in GFLOP/s, for
// the fp32 gemm on fp32 copies (the ceiling), the widen-to-fp32 path and oneDNN's bf16 matmul.
// The kAuto choice in kuai/backend/cpu/gemm_lowp.cpp follows from these numbers. Run with
// OMP_NUM_THREADS=2:
//   OMP_NUM_THREADS=2 build/kuai_bench_ops --benchmark_filter=BM_GemmLowp
//     --benchmark_repetitions=3 --benchmark_min_time=0.3
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kuai/backend/cpu/gemm.h"
#include "kuai/backend/cpu/gemm_lowp.h"
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

enum class Variant { kFp32, kConvert, kOneDNN };

const char* variant_name(Variant v) {
  return v == Variant::kFp32 ? "fp32_gemm" : v == Variant::kConvert ? "convert_fp32" : "onednn";
}

// y(M,N) = x(M,K) @ W(N,K)^T: the forward product of a linear layer, as bench_gemm.cpp's fwd_NT.
// kFp32 multiplies fp32 copies with cpu::gemm (automatic backend); the others bf16 operands with
// gemm_lowp on a forced path, into an fp32 (`c_type` kF32) or bf16 output.
void bench_lowp(benchmark::State& state, Variant variant, int64_t M, int64_t N, int64_t K,
                DType c_type) {
  const std::vector<float> x = random_floats(M * K, 1), w = random_floats(N * K, 2);
  const std::vector<uint16_t> x16 = to_bf16(x), w16 = to_bf16(w);
  std::vector<float> y(static_cast<size_t>(M * N));
  std::vector<uint16_t> y16(static_cast<size_t>(M * N));
  void* out = c_type == DType::kF32 ? static_cast<void*>(y.data()) : y16.data();
  kuai::cpu::set_lowp_gemm_path(variant == Variant::kOneDNN ? LowpGemmPath::kOneDNN
                                                            : LowpGemmPath::kConvertFp32);
  if (variant == Variant::kOneDNN) {
    // Without a oneDNN primitive gemm_lowp would silently widen; report that instead of timing it.
    const std::string impl = kuai::cpu::lowp_onednn_impl(false, true, M, N, K, DType::kBF16, K,
                                                         DType::kBF16, K, c_type, N);
    if (impl.empty()) {
      state.SkipWithError("oneDNN has no bf16 matmul on this CPU");
      return;
    }
    state.SetLabel(impl);
  }
  double best = 1e30;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    if (variant == Variant::kFp32) {
      kuai::cpu::gemm(false, true, M, N, K, 1.0f, x.data(), K, w.data(), K, 0.0f, y.data(), N);
    } else {
      kuai::cpu::gemm_lowp(false, true, M, N, K, 1.0f, x16.data(), DType::kBF16, K, w16.data(),
                           DType::kBF16, K, 0.0f, out, c_type, N);
    }
    benchmark::ClobberMemory();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  kuai::cpu::set_lowp_gemm_path(LowpGemmPath::kAuto);
  const double flops = 2.0 * static_cast<double>(M * N * K);
  state.counters["GFLOPS"] = benchmark::Counter(
      flops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["GFLOPS_best"] = flops * 1e-9 / best;
}

struct Layer {
  const char* name;
  int64_t rows, in, out;
};

const Layer kLayers[] = {
    {"tiny/qkv", 4096, 256, 768},  {"tiny/proj", 4096, 256, 256},
    {"tiny/fc", 4096, 256, 1024},  {"tiny/fc_proj", 4096, 1024, 256},
    {"gpt2/qkv", 1024, 768, 2304}, {"gpt2/proj", 1024, 768, 768},
    {"gpt2/fc", 1024, 768, 3072},  {"gpt2/fc_proj", 1024, 3072, 768},
};

const bool kRegistered = [] {
  for (const Layer& layer : kLayers) {
    for (Variant v : {Variant::kFp32, Variant::kConvert, Variant::kOneDNN}) {
      for (DType c_type : {DType::kF32, DType::kBF16}) {
        if (v == Variant::kFp32 && c_type != DType::kF32) continue;
        const std::string name = std::string("BM_GemmLowp/") + layer.name + "/" + variant_name(v) +
                                 (c_type == DType::kF32 ? "/out_f32" : "/out_bf16");
        benchmark::RegisterBenchmark(name.c_str(), bench_lowp, v, layer.rows, layer.out, layer.in,
                                     c_type)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  return true;
}();

}  // namespace
