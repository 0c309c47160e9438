// Micro-benchmarks of the CPU LayerNorm, embedding and cross-entropy kernels at GPT-2-like shapes.
// Throughput is reported as GB/s of the bytes each kernel must move at least once (inputs read
// plus outputs written); compare it with the machine's memory bandwidth.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kuai/backend/cpu/kernels.h"

namespace {

std::vector<float> random_floats(int64_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

std::vector<int32_t> random_ids(int64_t n, int32_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = dist(gen);
  return v;
}

void set_bytes(benchmark::State& state, int64_t bytes_per_iter) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * bytes_per_iter);
}

void BM_LayerNormForward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1);
  auto x = random_floats(N * C, -2.0f, 2.0f, 1);  // (N, C)
  auto w = random_floats(C, 0.5f, 1.5f, 2);
  auto b = random_floats(C, -0.5f, 0.5f, 3);
  std::vector<float> y(N * C), mean(N), rstd(N);
  for (auto _ : state) {
    kuai::cpu::layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(),
                                  N, C, 1e-5f);
    benchmark::DoNotOptimize(y.data());
  }
  set_bytes(state, 2 * N * C * 4);  // read x, write y
}
BENCHMARK(BM_LayerNormForward)->Args({4096, 256})->Args({1024, 768})->UseRealTime();

void BM_LayerNormBackward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1);
  auto x = random_floats(N * C, -2.0f, 2.0f, 1);  // (N, C)
  auto dy = random_floats(N * C, -1.0f, 1.0f, 4);
  auto w = random_floats(C, 0.5f, 1.5f, 2);
  auto b = random_floats(C, -0.5f, 0.5f, 3);
  std::vector<float> y(N * C), mean(N), rstd(N), dx(N * C), dw(C), db(C);
  kuai::cpu::layer_norm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), N,
                                C, 1e-5f);
  for (auto _ : state) {
    kuai::cpu::layer_norm_backward(dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                                   dx.data(), dw.data(), db.data(), N, C);
    benchmark::DoNotOptimize(dx.data());
  }
  set_bytes(state, 3 * N * C * 4);  // read dy and x, write dx
}
BENCHMARK(BM_LayerNormBackward)->Args({4096, 256})->Args({1024, 768})->UseRealTime();

void BM_EmbeddingForward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1), V = state.range(2);
  auto W = random_floats(V * C, -1.0f, 1.0f, 5);  // (V, C)
  auto idx = random_ids(N, static_cast<int32_t>(V), 6);
  std::vector<float> out(N * C);
  for (auto _ : state) {
    kuai::cpu::embedding_forward(W.data(), idx.data(), out.data(), N, C);
    benchmark::DoNotOptimize(out.data());
  }
  set_bytes(state, 2 * N * C * 4);  // gather N rows, write them
}
BENCHMARK(BM_EmbeddingForward)->Args({1024, 768, 50257})->UseRealTime();

void BM_EmbeddingBackward(benchmark::State& state) {
  const int64_t N = state.range(0), C = state.range(1), V = state.range(2);
  auto dout = random_floats(N * C, -1.0f, 1.0f, 7);  // (N, C)
  auto idx = random_ids(N, static_cast<int32_t>(V), 6);
  std::vector<float> dW(V * C);  // (V, C)
  for (auto _ : state) {
    kuai::cpu::embedding_backward(dout.data(), idx.data(), dW.data(), N, C, V);
    benchmark::DoNotOptimize(dW.data());
  }
  set_bytes(state, (V * C + N * C) * 4);  // write all of dW, read dout
}
BENCHMARK(BM_EmbeddingBackward)->Args({1024, 768, 50257})->UseRealTime();

void BM_CrossEntropyForward(benchmark::State& state) {
  const int64_t N = state.range(0), V = state.range(1);
  auto logits = random_floats(N * V, -8.0f, 8.0f, 8);  // (N, V)
  auto targets = random_ids(N, static_cast<int32_t>(V), 9);
  std::vector<float> lse(N);
  int64_t count = 0;
  for (auto _ : state) {
    double loss = kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), N, V,
                                                   -100, &count);
    benchmark::DoNotOptimize(loss);
  }
  set_bytes(state, N * V * 4);  // read the logits
}
BENCHMARK(BM_CrossEntropyForward)->Args({1024, 50257})->Args({4096, 256})->UseRealTime();

void BM_CrossEntropyBackward(benchmark::State& state) {
  const int64_t N = state.range(0), V = state.range(1);
  auto logits = random_floats(N * V, -8.0f, 8.0f, 8);  // (N, V)
  auto targets = random_ids(N, static_cast<int32_t>(V), 9);
  std::vector<float> lse(N), dlogits(N * V);
  int64_t count = 0;
  kuai::cpu::cross_entropy_forward(logits.data(), targets.data(), lse.data(), N, V, -100, &count);
  for (auto _ : state) {
    kuai::cpu::cross_entropy_backward(logits.data(), targets.data(), lse.data(), dlogits.data(), N,
                                      V, -100, 1.0f / static_cast<float>(N));
    benchmark::DoNotOptimize(dlogits.data());
  }
  set_bytes(state, 2 * N * V * 4);  // read the logits, write dlogits
}
BENCHMARK(BM_CrossEntropyBackward)->Args({1024, 50257})->Args({4096, 256})->UseRealTime();

}  // namespace
