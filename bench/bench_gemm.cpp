// Micro-benchmarks for kuai::cpu::gemm and gemm_batched: the GEMM shapes of a GPT training step
// (tiny GPT and GPT-2 124M linear layers, forward and both backward forms; per-head attention
// products as strided batches) on each backend, in GFLOP/s. The winners per shape class are
// encoded in kuai/backend/cpu/gemm.cpp. BM_GemmCeiling (2048^3 NN, automatic backend) is the
// machine's measured GEMM ceiling that kuai reports step throughput against. Run with
// OMP_NUM_THREADS=2; all benchmarks use wall-clock time.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kuai/backend/cpu/gemm/gemm.h"

namespace {

using kuai::cpu::GemmBackend;

// One product C(M,N) = op(A) @ op(B) + beta*C with minimal leading dimensions.
struct Problem {
  bool trans_a, trans_b;
  int64_t m, n, k;
  float beta;
};

// Values in [-1, 1) from a 32-bit LCG: cheap enough for the 50257-wide lm_head buffers.
std::vector<float> random_buffer(int64_t size, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(size));
  uint32_t state = seed * 2654435761u + 1u;
  for (float& x : v) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) * (2.0f / 16777216.0f) - 1.0f;
  }
  return v;
}

// Times each iteration separately. The machines are shared: GFLOPS (mean over the run) suffers
// whenever a neighbour steals a core, so GFLOPS_best (fastest single iteration) is the number
// to compare backends by.
class IterationTimer {
 public:
  void start() { start_ = std::chrono::steady_clock::now(); }
  void stop() {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (s < best_) best_ = s;
  }
  double best_seconds() const { return best_; }

 private:
  std::chrono::steady_clock::time_point start_;
  double best_ = 1e30;
};

void set_gflops(benchmark::State& state, double flops_per_iteration, const IterationTimer& timer) {
  state.counters["GFLOPS"] =
      benchmark::Counter(flops_per_iteration * 1e-9 * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["GFLOPS_best"] = flops_per_iteration * 1e-9 / timer.best_seconds();
}

const char* backend_name(GemmBackend backend) {
  switch (backend) {
    case GemmBackend::kOpenBLAS:
      return "openblas";
    case GemmBackend::kOneDNN:
      return "onednn";
    case GemmBackend::kKuai:
      return "kuai";
    case GemmBackend::kAuto:
      break;
  }
  return "auto";
}

void bench_gemm(benchmark::State& state, GemmBackend backend, Problem p) {
  const int64_t lda = p.trans_a ? p.m : p.k;
  const int64_t ldb = p.trans_b ? p.k : p.n;
  const std::vector<float> a = random_buffer(p.m * p.k, 1);
  const std::vector<float> b = random_buffer(p.k * p.n, 2);
  std::vector<float> c = random_buffer(p.m * p.n, 3);
  kuai::cpu::set_gemm_backend(backend);
  IterationTimer timer;
  for (auto _ : state) {
    timer.start();
    kuai::cpu::gemm(p.trans_a, p.trans_b, p.m, p.n, p.k, 1.0f, a.data(), lda, b.data(), ldb, p.beta,
                    c.data(), p.n);
    benchmark::ClobberMemory();
    timer.stop();
  }
  kuai::cpu::set_gemm_backend(GemmBackend::kAuto);
  set_gflops(state, 2.0 * static_cast<double>(p.m * p.n * p.k), timer);
}

// A linear layer y(M,N) = x(M,K) W(N,K)^T + b and its two backward products.
struct Linear {
  const char* name;
  int64_t rows, in, out;
};

void register_linear(const Linear& layer) {
  const int64_t M = layer.rows, K = layer.in, N = layer.out;
  const struct {
    const char* pass;
    Problem problem;
  } passes[] = {
      {"fwd_NT", {false, true, M, N, K, 1.0f}},  // y = x W^T (beta=1 onto the bias)
      {"dX_NN", {false, false, M, K, N, 0.0f}},  // dX = dY W
      {"dW_TN", {true, false, N, K, M, 1.0f}},   // dW += dY^T X (accumulated gradient)
  };
  for (const auto& pass : passes) {
    for (GemmBackend backend :
         {GemmBackend::kOneDNN, GemmBackend::kOpenBLAS, GemmBackend::kKuai, GemmBackend::kAuto}) {
      const std::string name =
          std::string("BM_Gemm/") + layer.name + "/" + pass.pass + "/" + backend_name(backend);
      benchmark::RegisterBenchmark(name.c_str(), bench_gemm, backend, pass.problem)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

// Per-head attention products over a (B,T,3C) qkv tensor: q/k/v are column slices (row stride
// 3C) at arbitrary offsets, the score matrix is (B,H,T,T) and the head output lives in (B,T,C).
struct Attention {
  const char* name;
  int64_t batch, heads, seq, head_dim;
};

enum class BatchStrategy { kGemmBatched, kLoopThreaded, kParallelSingle };

void run_batched(BatchStrategy strategy, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                 float alpha, const float* A, int64_t lda, const int64_t* a_off, const float* B,
                 int64_t ldb, const int64_t* b_off, float beta, float* C, int64_t ldc,
                 const int64_t* c_off, int64_t count) {
  switch (strategy) {
    case BatchStrategy::kGemmBatched:
      kuai::cpu::gemm_batched(ta, tb, M, N, K, alpha, A, lda, a_off, B, ldb, b_off, beta, C, ldc,
                              c_off, count);
      break;
    case BatchStrategy::kLoopThreaded:
      for (int64_t i = 0; i < count; ++i) {
        kuai::cpu::gemm(ta, tb, M, N, K, alpha, A + a_off[i], lda, B + b_off[i], ldb, beta,
                        C + c_off[i], ldc);
      }
      break;
    case BatchStrategy::kParallelSingle:
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) {
        kuai::cpu::gemm(ta, tb, M, N, K, alpha, A + a_off[i], lda, B + b_off[i], ldb, beta,
                        C + c_off[i], ldc);
      }
      break;
  }
}

enum class AttnProduct { kScores, kValues, kValueGrad };

void bench_attention(benchmark::State& state, GemmBackend backend, Attention at,
                     AttnProduct product) {
  const int64_t B = at.batch, H = at.heads, T = at.seq, D = at.head_dim, C = H * D;
  const int64_t count = B * H;
  const std::vector<float> qkv = random_buffer(B * T * 3 * C, 1);  // (B, T, 3C)
  std::vector<float> att = random_buffer(count * T * T, 2);        // (B, H, T, T)
  std::vector<float> y = random_buffer(B * T * C, 3);              // (B, T, C)
  std::vector<int64_t> q_off, k_off, v_off, att_off, y_off;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      q_off.push_back(b * T * 3 * C + h * D);
      k_off.push_back(b * T * 3 * C + C + h * D);
      v_off.push_back(b * T * 3 * C + 2 * C + h * D);
      att_off.push_back((b * H + h) * T * T);
      y_off.push_back(b * T * C + h * D);
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto strategy = static_cast<BatchStrategy>(state.range(0));
  kuai::cpu::set_gemm_backend(backend);
  float* qkv_out = const_cast<float*>(qkv.data());
  IterationTimer timer;
  for (auto _ : state) {
    timer.start();
    switch (product) {
      case AttnProduct::kScores:  // att = scale * q k^T, (T,D)x(D,T); also dP = dY V^T
        run_batched(strategy, false, true, T, T, D, scale, qkv.data(), 3 * C, q_off.data(),
                    qkv.data(), 3 * C, k_off.data(), 0.0f, att.data(), T, att_off.data(), count);
        break;
      case AttnProduct::kValues:  // y = P v, (T,T)x(T,D); also dQ = dS K
        run_batched(strategy, false, false, T, D, T, 1.0f, att.data(), T, att_off.data(),
                    qkv.data(), 3 * C, v_off.data(), 0.0f, y.data(), C, y_off.data(), count);
        break;
      case AttnProduct::kValueGrad:  // dv = P^T dy, (T,T)^T x (T,D); also dK = dS^T Q
        run_batched(strategy, true, false, T, D, T, 1.0f, att.data(), T, att_off.data(), y.data(),
                    C, y_off.data(), 0.0f, qkv_out, 3 * C, v_off.data(), count);
        break;
    }
    benchmark::ClobberMemory();
    timer.stop();
  }
  kuai::cpu::set_gemm_backend(GemmBackend::kAuto);
  set_gflops(state, 2.0 * static_cast<double>(count * T * T * D), timer);
}

void register_attention(const Attention& at) {
  const struct {
    const char* name;
    AttnProduct product;
  } products[] = {{"scores_NT", AttnProduct::kScores},
                  {"values_NN", AttnProduct::kValues},
                  {"value_grad_TN", AttnProduct::kValueGrad}};
  for (const auto& pr : products) {
    for (GemmBackend backend : {GemmBackend::kOneDNN, GemmBackend::kOpenBLAS, GemmBackend::kAuto}) {
      const std::string name =
          std::string("BM_GemmBatched/") + at.name + "/" + pr.name + "/" + backend_name(backend);
      benchmark::RegisterBenchmark(name.c_str(), bench_attention, backend, at, pr.product)
          ->ArgName("strategy")  // 0: gemm_batched, 1: loop of threaded gemm, 2: omp over batch
          ->DenseRange(0, backend == GemmBackend::kAuto ? 0 : 2)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

// Square batched NN products of growing size: where parallel-over-batch (one single-threaded
// product per thread) stops beating a loop of threaded products. Args: n, strategy (1 or 2).
void bench_batched_crossover(benchmark::State& state, GemmBackend backend) {
  const int64_t n = state.range(0), count = 16;
  const auto strategy = static_cast<BatchStrategy>(state.range(1));
  const std::vector<float> a = random_buffer(count * n * n, 1);
  const std::vector<float> b = random_buffer(count * n * n, 2);
  std::vector<float> c = random_buffer(count * n * n, 3);
  std::vector<int64_t> off;
  for (int64_t i = 0; i < count; ++i) off.push_back(i * n * n);
  kuai::cpu::set_gemm_backend(backend);
  IterationTimer timer;
  for (auto _ : state) {
    timer.start();
    run_batched(strategy, false, false, n, n, n, 1.0f, a.data(), n, off.data(), b.data(), n,
                off.data(), 0.0f, c.data(), n, off.data(), count);
    benchmark::ClobberMemory();
    timer.stop();
  }
  kuai::cpu::set_gemm_backend(GemmBackend::kAuto);
  set_gflops(state, 2.0 * static_cast<double>(count * n * n * n), timer);
}

// What one small product costs inside a parallel region, each thread running its own (as
// attention's per-head tiles do): microseconds per call and GFLOP/s per thread, for the tile
// shapes of a 256-position head with d 64. Arguments: transposes (bit 1: A, bit 0: B), M, N, K.
void BM_SmallProductPerThread(benchmark::State& state) {
  const bool ta = (state.range(0) & 2) != 0, tb = (state.range(0) & 1) != 0;
  const int64_t m = state.range(1), n = state.range(2), k = state.range(3);
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
  constexpr int kCalls = 1000;
  const int threads = omp_get_max_threads();
  std::vector<std::vector<float>> a(threads), b(threads), c(threads);
  for (int t = 0; t < threads; ++t) {
    a[t].assign(static_cast<size_t>(m * k), 0.5f);
    b[t].assign(static_cast<size_t>(k * n), 0.25f);
    c[t].resize(static_cast<size_t>(m * n));
  }
  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num();
      for (int r = 0; r < kCalls; ++r)
        kuai::cpu::gemm(ta, tb, m, n, k, 1.0f, a[t].data(), lda, b[t].data(), ldb, 0.0f,
                        c[t].data(), n);
    }
  }
  const double calls = static_cast<double>(state.iterations()) * kCalls;
  state.counters["us/call"] =
      benchmark::Counter(calls * 1e-6, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["GFLOP/s/thread"] =
      benchmark::Counter(2.0 * m * n * k * calls * 1e-9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SmallProductPerThread)
    ->ArgNames({"t", "m", "n", "k"})
    ->Args({1, 64, 64, 64})
    ->Args({1, 64, 256, 64})
    ->Args({0, 64, 64, 256})
    ->Args({2, 64, 64, 192})
    ->Repetitions(3)
    ->ReportAggregatesOnly(true)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_GemmCeiling(benchmark::State& state) {
  bench_gemm(state, GemmBackend::kAuto, {false, false, 2048, 2048, 2048, 0.0f});
}
BENCHMARK(BM_GemmCeiling)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);

const bool kRegistered = [] {
  for (const Linear& layer :
       {Linear{"tiny/qkv", 4096, 256, 768}, Linear{"tiny/proj", 4096, 256, 256},
        Linear{"tiny/fc", 4096, 256, 1024}, Linear{"tiny/fc_proj", 4096, 1024, 256},
        Linear{"gpt2/qkv", 1024, 768, 2304}, Linear{"gpt2/proj", 1024, 768, 768},
        Linear{"gpt2/fc", 1024, 768, 3072}, Linear{"gpt2/fc_proj", 1024, 3072, 768},
        Linear{"gpt2/lm_head", 1024, 768, 50257}}) {
    register_linear(layer);  // tiny GPT's lm_head (vocab 256) has the tiny/proj shape
  }
  register_attention({"gpt2", 4, 12, 256, 64});
  register_attention({"tiny", 16, 8, 256, 32});
  for (GemmBackend backend : {GemmBackend::kOneDNN, GemmBackend::kOpenBLAS}) {
    const std::string name = std::string("BM_BatchedCrossover/") + backend_name(backend);
    benchmark::RegisterBenchmark(name.c_str(), bench_batched_crossover, backend)
        ->ArgNames({"n", "strategy"})
        ->ArgsProduct({{32, 64, 128, 256, 512}, {1, 2}})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  return true;
}();

}  // namespace
