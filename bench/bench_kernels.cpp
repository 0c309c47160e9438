// Micro-benchmarks of the elementwise, softmax, reduction and optimizer kernels at GPT-2 small
// sizes, reported as bytes moved per second (each array read or written once counts once), next
// to the machine's STREAM triad bandwidth measured in the same run. Memory-bound kernels should
// approach the triad figure; AdamW moves 28 bytes per parameter (reads p, g, m, v; writes p, m, v).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"

namespace kuai::cpu {
namespace {

[[maybe_unused]] const int kIsaContext = (benchmark::AddCustomContext("kuai_isa", isa_name()), 0);

std::vector<float> filled(int64_t n, float value) {
  std::vector<float> v(n);
  fill(v.data(), value, n);  // parallel first touch
  return v;
}

void set_bytes(benchmark::State& state, int64_t bytes_per_iter) {
  state.SetBytesProcessed(state.iterations() * bytes_per_iter);
}

// STREAM triad a = b + s c on 3 x 128 MiB (4x the 32 MiB L3), both cores; 12 bytes/element as
// STREAM counts it (the write-allocate read of a is not counted).
void BM_stream_triad(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto a = filled(n, 0.0f), b = filled(n, 1.0f), c = filled(n, 2.0f);
  const float s = 3.0f;
  for (auto _ : state) {
    float* pa = a.data();
    const float* pb = b.data();
    const float* pc = c.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + s * pc[i];
    benchmark::ClobberMemory();
  }
  set_bytes(state, 12 * n);
}
BENCHMARK(BM_stream_triad)->Arg(int64_t{1} << 25)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_add(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto a = filled(n, 1.0f), b = filled(n, 2.0f), y = filled(n, 0.0f);
  for (auto _ : state) {
    add(a.data(), b.data(), y.data(), n);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 12 * n);
}
BENCHMARK(BM_add)->Arg(4096 * 768)->Arg(int64_t{1} << 25)->UseRealTime();

// MLP activations of GPT-2 small: (B*T, 4C) = 1024 x 3072 and 4096 x 1024.
void BM_gelu_forward(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> x(n), y(n);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 2001) * 0.005f - 5.0f;
  for (auto _ : state) {
    gelu_forward(x.data(), y.data(), n);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 8 * n);
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_gelu_forward)->Arg(1024 * 3072)->Arg(4096 * 1024)->UseRealTime();

void BM_gelu_backward(benchmark::State& state) {
  const int64_t n = state.range(0);
  std::vector<float> x(n), dy(n, 1.0f), dx(n);
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 2001) * 0.005f - 5.0f;
  for (auto _ : state) {
    gelu_backward(x.data(), dy.data(), dx.data(), n);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 12 * n);
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_gelu_backward)->Arg(1024 * 3072)->Arg(4096 * 1024)->UseRealTime();

// Attention scores of GPT-2 small at T = 256: (B*H*T, T) = (48*256, 256), causal, scale 1/8.
void BM_softmax_forward(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  std::vector<float> x(rows * cols), y(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = static_cast<float>(i % 977) * 0.01f - 5.0f;
  for (auto _ : state) {
    softmax_forward(x.data(), y.data(), rows, cols, 0.125f, true);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 8 * rows * cols);
}
BENCHMARK(BM_softmax_forward)->Args({48 * 256, 256})->UseRealTime();

void BM_softmax_backward(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  std::vector<float> x(rows * cols), y(rows * cols), dy(rows * cols, 0.5f), dx(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = static_cast<float>(i % 977) * 0.01f - 5.0f;
  softmax_forward(x.data(), y.data(), rows, cols, 0.125f, true);
  for (auto _ : state) {
    softmax_backward(y.data(), dy.data(), dx.data(), rows, cols, 0.125f);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 12 * rows * cols);
}
BENCHMARK(BM_softmax_backward)->Args({48 * 256, 256})->UseRealTime();

// Bias gradient of a (B*T, 4C) activation: sum over 8192 rows of 3072 columns.
void BM_sum_axis(benchmark::State& state) {
  const int64_t n = state.range(0), inner = state.range(1);
  auto x = filled(n * inner, 0.5f);
  std::vector<float> y(inner);
  for (auto _ : state) {
    sum_axis(x.data(), y.data(), 1, n, inner);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 4 * n * inner);
}
BENCHMARK(BM_sum_axis)->Args({8192, 768})->Args({8192, 3072})->UseRealTime();

void BM_sum_squares(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto x = filled(n, 0.5f);
  for (auto _ : state) benchmark::DoNotOptimize(sum_squares(x.data(), n));
  set_bytes(state, 4 * n);
}
BENCHMARK(BM_sum_squares)->Arg(124'000'000)->UseRealTime()->Unit(benchmark::kMillisecond);

// AdamW's memory pattern with no arithmetic to speak of (read p, g, m, v; write p, m, v): the
// practical floor for a streaming optimizer step on this machine.
void BM_adamw_pattern_floor(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = filled(n, 0.5f), g = filled(n, 0.01f), m = filled(n, 0.0f), v = filled(n, 0.0f);
  for (auto _ : state) {
    float* pp = p.data();
    const float* pg = g.data();
    float* pm = m.data();
    float* pv = v.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      pp[i] += pg[i];
      pm[i] += pg[i];
      pv[i] += pg[i];
    }
    benchmark::ClobberMemory();
  }
  set_bytes(state, 28 * n);
}
BENCHMARK(BM_adamw_pattern_floor)->Arg(124'000'000)->UseRealTime()->Unit(benchmark::kMillisecond);

// AdamW over GPT-2 small's 124M parameters (one flat buffer) and over a 1M-element tensor.
void BM_adamw(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = filled(n, 0.5f), g = filled(n, 0.01f), m = filled(n, 0.0f), v = filled(n, 0.0f);
  const AdamWParams hp{6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.6513f, 0.4013f, 1.0f};
  for (auto _ : state) {
    adamw_step(p.data(), g.data(), m.data(), v.data(), n, hp);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 28 * n);
}
BENCHMARK(BM_adamw)->Arg(1'000'000)->Arg(124'000'000)->UseRealTime()->Unit(benchmark::kMillisecond);

// SGD with momentum: reads p, g, buf; writes p, buf (20 bytes/param).
void BM_sgd_momentum(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = filled(n, 0.5f), g = filled(n, 0.01f), buf = filled(n, 0.0f);
  for (auto _ : state) {
    sgd_step(p.data(), g.data(), buf.data(), n, 0.01f, 0.9f, 0.0f, 1e-4f, true, false, 1.0f);
    benchmark::ClobberMemory();
  }
  set_bytes(state, 20 * n);
}
BENCHMARK(BM_sgd_momentum)->Arg(124'000'000)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kuai::cpu
