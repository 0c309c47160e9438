// Micro-benchmarks of the CPU attention kernels at the sweep shape (B = 1, H = 12,
// head_dim 64, causal, fp32): flash forward and backward against the naive per-head kernels'
// forward and backward, over T. Counters: achieved GFLOP/s with causal FLOPs counted honestly (the
// products over the visible half of the square: 4 T^2 d / 2 per head forward, 8 T^2 d / 2 backward,
// the recomputation of the scores not counted).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kuai/backend/cpu/attention.h"
#include "kuai/backend/cpu/flash_attention.h"

namespace {

constexpr int64_t kHeads = 12, kDim = 64;

std::vector<float> random_floats(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Causal FLOPs of the attention products of one pass (fwd: 2 products, bwd: 4).
double causal_flops(int64_t T, int products) {
  return static_cast<double>(products) * 2.0 * static_cast<double>(T) * (T + 1) / 2.0 * kDim *
         kHeads;
}

struct Qkv {
  explicit Qkv(int64_t T)
      : T(T),
        q(random_floats(kHeads * T * kDim, 1)),
        k(random_floats(kHeads * T * kDim, 2)),
        v(random_floats(kHeads * T * kDim, 3)),
        o(kHeads * T * kDim),
        lse(kHeads * T),
        dout(random_floats(kHeads * T * kDim, 4)),
        dq(kHeads * T * kDim),
        dk(kHeads * T * kDim),
        dv(kHeads * T * kDim) {}
  int64_t T;
  std::vector<float> q, k, v, o, lse, dout, dq, dk, dv;
  std::vector<kuai::cpu::FlashHead> heads() {
    std::vector<kuai::cpu::FlashHead> hs;
    for (int64_t h = 0; h < kHeads; ++h) {
      const int64_t off = h * T * kDim;
      hs.push_back({q.data() + off, k.data() + off, v.data() + off, o.data() + off,
                    lse.data() + h * T, kDim, kDim, kDim, kDim});
    }
    return hs;
  }
  std::vector<kuai::cpu::FlashHeadGrad> grads() {
    std::vector<kuai::cpu::FlashHeadGrad> hs;
    for (int64_t h = 0; h < kHeads; ++h) {
      const int64_t off = h * T * kDim;
      hs.push_back({q.data() + off, k.data() + off, v.data() + off, o.data() + off,
                    dout.data() + off, lse.data() + h * T, dq.data() + off, dk.data() + off,
                    dv.data() + off, kDim, kDim, kDim, kDim, kDim, kDim, kDim, kDim});
    }
    return hs;
  }
};

const float kScale = 0.125f;

void BM_FlashForward(benchmark::State& state) {
  Qkv x(state.range(0));
  auto hs = x.heads();
  for (auto _ : state) kuai::cpu::flash_attention_forward(hs, {x.T, x.T, kDim, kScale, true});
  state.counters["GFLOP/s"] = benchmark::Counter(causal_flops(x.T, 2) * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}

// The backward with its block products on the libraries (BM_FlashBackward) or on the small GEMM
// (BM_FlashBackwardSmall); the model's flash takes whichever the machine measured faster.
void flash_backward(benchmark::State& state, kuai::cpu::BlockProducts products) {
  Qkv x(state.range(0));
  auto hs = x.heads();
  kuai::cpu::flash_attention_forward(hs, {x.T, x.T, kDim, kScale, true});
  auto gs = x.grads();
  for (auto _ : state)
    kuai::cpu::flash_attention_backward(gs, {x.T, x.T, kDim, kScale, true}, products);
  state.counters["GFLOP/s"] = benchmark::Counter(causal_flops(x.T, 4) * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}
void BM_FlashBackward(benchmark::State& state) {
  flash_backward(state, kuai::cpu::BlockProducts::kLibrary);
}
void BM_FlashBackwardSmall(benchmark::State& state) {
  flash_backward(state, kuai::cpu::BlockProducts::kSmall);
}

// The naive kernels with their products on the libraries (BM_Naive*) or on the small GEMM
// (BM_Naive*Small: k^T or v^T in d x T more scratch).
void naive_forward(benchmark::State& state, bool small) {
  Qkv x(state.range(0));
  const int64_t T = x.T;
  for (auto _ : state) {
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < kHeads; ++h) {
      thread_local std::vector<float> p, s, bt;
      p.resize(T * T);
      s.resize(T * T);
      bt.resize(kDim * T);
      const int64_t off = h * T * kDim;
      kuai::cpu::attention_head_forward(kuai::cpu::HeadView{x.q.data() + off, x.k.data() + off,
                                                            x.v.data() + off, kDim, kDim, kDim},
                                        p.data(), x.o.data() + off, kDim, T, kDim, kScale, true,
                                        s.data(), small ? bt.data() : nullptr);
    }
  }
  state.counters["GFLOP/s"] = benchmark::Counter(causal_flops(T, 2) * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}

void BM_NaiveForward(benchmark::State& state) { naive_forward(state, false); }
void BM_NaiveForwardSmall(benchmark::State& state) { naive_forward(state, true); }

// The naive backward from each head's probabilities (made once by the forward): dq, dk, dv.
void naive_backward(benchmark::State& state, bool small) {
  Qkv x(state.range(0));
  const int64_t T = x.T;
  std::vector<float> probs(kHeads * T * T);
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < kHeads; ++h) {
    std::vector<float> s(T * T);
    const int64_t off = h * T * kDim;
    kuai::cpu::attention_head_forward(
        kuai::cpu::HeadView{x.q.data() + off, x.k.data() + off, x.v.data() + off, kDim, kDim, kDim},
        probs.data() + h * T * T, x.o.data() + off, kDim, T, kDim, kScale, true, s.data());
  }
  for (auto _ : state) {
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < kHeads; ++h) {
      thread_local std::vector<float> dp, bt;
      dp.resize(T * T);
      bt.resize(kDim * T);
      const int64_t off = h * T * kDim;
      kuai::cpu::attention_head_backward(kuai::cpu::HeadView{x.q.data() + off, x.k.data() + off,
                                                             x.v.data() + off, kDim, kDim, kDim},
                                         probs.data() + h * T * T, x.dout.data() + off, kDim,
                                         x.dq.data() + off, kDim, x.dk.data() + off, kDim,
                                         x.dv.data() + off, kDim, T, kDim, kScale, true, dp.data(),
                                         small ? bt.data() : nullptr);
    }
  }
  state.counters["GFLOP/s"] = benchmark::Counter(causal_flops(T, 4) * state.iterations() / 1e9,
                                                 benchmark::Counter::kIsRate);
}
void BM_NaiveBackward(benchmark::State& state) { naive_backward(state, false); }
void BM_NaiveBackwardSmall(benchmark::State& state) { naive_backward(state, true); }

BENCHMARK(BM_FlashForward)
    ->Arg(256)
    ->Arg(512)
    ->Arg(1024)
    ->Arg(2048)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlashBackward)
    ->Arg(256)
    ->Arg(512)
    ->Arg(1024)
    ->Arg(2048)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FlashBackwardSmall)
    ->Arg(256)
    ->Arg(512)
    ->Arg(1024)
    ->Arg(2048)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_NaiveForward)->Arg(256)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_NaiveBackward)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_NaiveForwardSmall)
    ->Arg(256)
    ->Arg(512)
    ->Arg(1024)
    ->Arg(2048)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_NaiveBackwardSmall)->Arg(256)->Arg(512)->Arg(1024)->Unit(benchmark::kMillisecond);

}  // namespace
