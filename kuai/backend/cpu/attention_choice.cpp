// Naive or flash attention, by measurement on this machine (see attention_choice.h).
#include "kuai/backend/cpu/attention_choice.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/core/autograd.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"
#include "kuai/core/rng.h"

namespace kuai::cpu {
namespace {

constexpr int kMinRounds = 3;
constexpr int kMaxRounds = 20;
constexpr double kMinSeconds = 0.3;
constexpr double kMaxProbabilityBytes = double(int64_t{1} << 30);
// Attentions under this many multiply-adds of QK^T (batch x heads x T^2 x d, at the measured
// batch) are not measured: both kernels take microseconds there, mostly call overhead.
constexpr double kMinMeasuredMacs = double(int64_t{1} << 24);

struct FakeTimer {
  std::mutex mu;
  std::function<double(const AttentionShape&, AttentionKernel)> fn;
};
FakeTimer& fake_timer() {
  static FakeTimer t;
  return t;
}

const char* kernel_name(AttentionKernel k) {
  return k == AttentionKernel::kFlash ? "flash" : "naive";
}

// Forward and backward of one kernel on the operands, as a training step runs them (the
// primitives the model's attention and its vjp dispatch).
void run_kernel(AttentionKernel kernel, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& dy, bool causal) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(q.size(3)));
  if (kernel == AttentionKernel::kFlash) {
    std::vector<Tensor> out = dispatch(std::make_shared<FlashAttention>(scale, causal), {q, k, v});
    dispatch(std::make_shared<FlashAttentionBackward>(scale, causal),
             {q, k, v, out[0], out[1], dy});
  } else {
    std::vector<Tensor> out = dispatch(std::make_shared<Attention>(scale, causal), {q, k, v});
    dispatch(std::make_shared<AttentionBackward>(scale, causal), {q, k, v, out[1], dy});
  }
}

}  // namespace

std::string attention_key(const AttentionShape& s) {
  return fmt::format("attention H{} kv{} T{} d{} {} {} t{}", s.heads, s.kv_heads, s.seq, s.head_dim,
                     dtype_name(s.dtype), s.causal ? "causal" : "full", omp_get_max_threads());
}

AttentionKernel choose_attention_kernel(const AttentionShape& s) {
  const AttentionKernel fallback = default_attention_kernel(s);
  TuningCache& cache = TuningCache::get();
  if (!cache.enabled() || routes_to_default_here()) return fallback;
  const std::string key = attention_key(s);
  auto from_name = [](const std::string& name) {
    return name == "flash" ? AttentionKernel::kFlash : AttentionKernel::kNaive;
  };
  if (const auto cached = cache.find(key); cached && (*cached == "flash" || *cached == "naive"))
    return from_name(*cached);
  if (!cache.may_calibrate()) return fallback;

  // Enough (batch, head) pairs for every thread several times over.
  const int64_t threads = omp_get_max_threads();
  const int64_t batch = std::max<int64_t>(1, (4 * threads + s.heads - 1) / s.heads);
  const double macs =
      double(batch) * double(s.heads) * double(s.seq) * double(s.seq) * double(s.head_dim);
  if (macs < kMinMeasuredMacs) return fallback;
  const double p_bytes =
      double(batch) * double(s.heads) * double(s.seq) * double(s.seq) * double(dtype_size(s.dtype));
  if (p_bytes > kMaxProbabilityBytes) {
    return from_name(
        cache.record({key, "flash",
                      fmt::format("naive not run: its probabilities would take {:.1f} GiB",
                                  p_bytes / (1 << 30))}));
  }

  // Ops of its own in the middle of a step: no capture records them, no autocast casts them, no
  // autograd node is made.
  NoModesGuard no_modes;
  autograd::NoGradGuard no_grad;
  Generator g(29, 0);
  const int64_t B = batch, H = s.heads, Hkv = s.kv_heads, T = s.seq, d = s.head_dim;
  const Tensor q = cast(g.normal({B, H, T, d}, 0.0f, 1.0f, kCPU), s.dtype);
  const Tensor k = cast(g.normal({B, Hkv, T, d}, 0.0f, 1.0f, kCPU), s.dtype);
  const Tensor v = cast(g.normal({B, Hkv, T, d}, 0.0f, 1.0f, kCPU), s.dtype);
  const Tensor dy = cast(g.normal({B, T, H, d}, 0.0f, 1.0f, kCPU), s.dtype);

  std::function<double(const AttentionShape&, AttentionKernel)> fake;
  {
    std::lock_guard<std::mutex> lock(fake_timer().mu);
    fake = fake_timer().fn;
  }
  const AttentionKernel kernels[] = {AttentionKernel::kNaive, AttentionKernel::kFlash};
  const std::function<void()> runs[] = {[&] { run_kernel(kernels[0], q, k, v, dy, s.causal); },
                                        [&] { run_kernel(kernels[1], q, k, v, dy, s.causal); }};
  const std::vector<double> best =
      race(runs, {kMinRounds, kMaxRounds, kMinSeconds}, {},
           fake ? std::function<double(size_t)>([&](size_t i) { return fake(s, kernels[i]); })
                : std::function<double(size_t)>());
  const int winner = best[1] < best[0] ? 1 : 0;  // a tie keeps naive
  const std::string measured =
      fmt::format("naive {:.2f} flash {:.2f} ms, forward+backward at batch {}", best[0] * 1e3,
                  best[1] * 1e3, batch);
  return from_name(cache.record({key, kernel_name(kernels[winner]), measured}));
}

void set_attention_timer(std::function<double(const AttentionShape&, AttentionKernel)> timer) {
  std::lock_guard<std::mutex> lock(fake_timer().mu);
  fake_timer().fn = std::move(timer);
}

}  // namespace kuai::cpu
