// The interleaved eager / compiled step benchmark (see compile_bench.h).
#include "kuai/train/compile_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "kuai/amp/autocast.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/compile/compile.h"
#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/train/trainer.h"

namespace kuai::train {

namespace {

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

// One arm's model, optimizer and scaler (the same seed in every arm: the same weights).
struct Learner {
  Learner(const TrainConfig& cfg)
      : cfg(cfg),
        compute(amp::precision_dtype(cfg.precision)),
        model(cfg.model, static_cast<uint64_t>(cfg.seed)),
        opt(param_groups(model, static_cast<float>(cfg.weight_decay)),
            {static_cast<float>(cfg.lr), static_cast<float>(cfg.beta1),
             static_cast<float>(cfg.beta2)}),
        scaler([&] {
          amp::GradScalerOptions o;
          o.enabled = compute == DType::kF16;
          o.init_scale = static_cast<float>(cfg.loss_scale);
          o.growth_interval = cfg.loss_scale_growth_interval;
          return o;
        }()) {
    opt.ensure_state();
  }
  // The trainer's single-process step on `batch` (x, y per micro-batch): {loss, grad norm}.
  std::vector<Tensor> step(const std::vector<Tensor>& batch) {
    const auto k = static_cast<int64_t>(batch.size() / 2);
    std::optional<amp::AutocastGuard> amp;
    if (compute != DType::kF32) amp.emplace(true, compute);
    Tensor factor;
    if (scaler.enabled()) {
      autograd::NoGradGuard no_grad;
      factor = scale(scaler.scale_tensor(), 1.0f / static_cast<float>(k));
    }
    Tensor loss;
    for (int64_t m = 0; m < k; ++m) {
      const Tensor &x = batch[static_cast<size_t>(2 * m)],
                   &y = batch[static_cast<size_t>(2 * m + 1)];
      Tensor l = factor.defined() ? forward_backward(model, x, y, factor)
                                  : forward_backward(model, x, y, 1.0f / static_cast<float>(k));
      autograd::NoGradGuard no_grad;
      loss = loss.defined() ? add(loss, l) : l;
    }
    amp.reset();
    if (k > 1) {
      autograd::NoGradGuard no_grad;
      loss = scale(loss, 1.0f / static_cast<float>(k));
    }
    const std::vector<Tensor> params = model.parameters();
    const Tensor found_inf = scaler.unscale_(params);
    const Tensor norm = optim::grad_norm_tensor(params);
    scaler.step_on_device(opt, found_inf,
                          optim::clip_coefficient(norm, static_cast<float>(cfg.grad_clip)));
    scaler.update(found_inf);
    opt.zero_grad();
    return {loss, norm};
  }
  TrainConfig cfg;
  DType compute;
  nn::GPT model;
  optim::AdamW opt;
  amp::GradScaler scaler;
};

}  // namespace

CompileBench run_compile_bench(const TrainConfig& cfg, int64_t steps, int64_t warmup,
                               std::ostream& progress) {
  if (steps <= warmup) throw std::invalid_argument("bench compile: --steps must exceed --warmup");
  const int64_t B = cfg.batch_size, T = cfg.model.seq_len, k = cfg.accum_steps;
  CompileBench bench;
  bench.precision = cfg.precision;
  bench.steps = steps;
  bench.warmup = warmup;
  bench.model =
      fmt::format("{}, vocab {}, T {}, batch {}{}", nn::describe(cfg.model), cfg.model.vocab_size,
                  T, B, k > 1 ? fmt::format(" x {} micro-batches", k) : "");
  struct Arm {
    CompileBenchArm info;
    std::unique_ptr<Learner> learner;
    std::optional<CompiledStep> compiled;
  };
  std::vector<Arm> arms;
  auto arm_info = [](std::string label, std::string disabled, bool compiled) {
    CompileBenchArm a;
    a.label = std::move(label);
    a.disabled = std::move(disabled);
    a.compiled = compiled;
    return a;
  };
  arms.push_back({arm_info("eager", "", false), std::make_unique<Learner>(cfg), std::nullopt});
  std::vector<std::string> variants = {""};
  for (const std::string& p : compiler::PassOptions::names()) variants.push_back(p);
  for (const std::string& off : variants) {
    Arm a{arm_info(off.empty() ? "compiled" : "compiled without " + off, off, true),
          std::make_unique<Learner>(cfg), std::nullopt};
    Learner* l = a.learner.get();
    CompileOptions co;
    co.module = &l->model;
    co.passes = compiler::PassOptions::all_but(off);
    co.log = [&progress](const std::string& m) { progress << m << "\n"; };
    a.compiled.emplace(
        kuai::compile([l](const std::vector<Tensor>& in) { return l->step(in); }, co));
    arms.push_back(std::move(a));
  }
  progress << fmt::format("bench compile ({}, {}): {} steps, {} dropped, {} arms interleaved\n",
                          cfg.precision, bench.model, steps, warmup, arms.size());
  using Clock = std::chrono::steady_clock;
  std::vector<Tensor> batch;
  for (int64_t i = 0; i < 2 * k; ++i) batch.push_back(Tensor::empty({B, T}, DType::kI32));
  for (int64_t s = 0; s < steps; ++s) {
    Generator g(static_cast<uint64_t>(cfg.seed) + 7919 * static_cast<uint64_t>(s), 0);
    for (Tensor& t : batch) t = g.randint({B, T}, 0, static_cast<int32_t>(cfg.model.vocab_size));
    const float lr = static_cast<float>(learning_rate(cfg, s));
    std::vector<size_t> order(arms.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = s % 2 ? order.size() - 1 - i : i;
    std::vector<float> losses(arms.size());
    for (size_t i : order) {
      Arm& a = arms[i];
      a.learner->opt.set_lr(lr);
      const auto t0 = Clock::now();
      const std::vector<Tensor> out = a.compiled ? (*a.compiled)(batch) : a.learner->step(batch);
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (s >= warmup) a.info.step_ms.push_back(ms);
      losses[i] = out[0].item();
    }
    for (size_t i = 1; i < arms.size(); ++i)
      bench.losses_equal = bench.losses_equal && losses[i] == losses[0];
    progress << fmt::format("  step {:>3}: loss {:.4f}{}\n", s + 1, losses[0],
                            bench.losses_equal ? "" : " (an arm differs from eager)");
  }
  // Memory: one more step of eager and of the full compiled arm, alone.
  for (size_t i : {size_t{0}, size_t{1}}) {
    Arm& a = arms[i];
    const int64_t base = Allocator::get().stats().current;
    Allocator::get().reset_peak();
    (void)(a.compiled ? (*a.compiled)(batch) : a.learner->step(batch));
    const int64_t peak = Allocator::get().stats().peak - base;
    (i == 0 ? bench.eager_peak_bytes : bench.compiled_peak_bytes) = peak;
  }
  bench.compiled_peak_bytes += arms[1].compiled->executable()
                                   ? arms[1].compiled->executable()->arena_bytes()
                                   : 0;  // the arena lives between steps: part of the step's memory
  const double eager_median = quantile(arms[0].info.step_ms, 0.5);
  for (Arm& a : arms) {
    CompileBenchArm& x = a.info;
    x.median_ms = quantile(x.step_ms, 0.5);
    x.p25_ms = quantile(x.step_ms, 0.25);
    x.p75_ms = quantile(x.step_ms, 0.75);
    x.speedup = x.median_ms > 0 ? eager_median / x.median_ms : 0;
    if (a.compiled && a.compiled->executable()) {
      x.nodes = static_cast<int64_t>(a.compiled->executable()->graph().nodes.size());
      x.arena_bytes = a.compiled->executable()->arena_bytes();
    }
    bench.arms.push_back(x);
  }
  return bench;
}

std::string compile_bench_markdown(const std::vector<CompileBench>& runs) {
  std::string s;
  for (const CompileBench& b : runs) {
    s += fmt::format(
        "\n{} ({}): {} steps interleaved, {} dropped; losses of every arm equal to eager's: "
        "{}\n\n| arm | step ms median (p25-p75) | vs eager | graph nodes | arena MiB |\n"
        "|---|---|---|---|---|\n",
        b.model, b.precision, b.steps, b.warmup, b.losses_equal ? "yes, bit for bit" : "NO");
    for (const CompileBenchArm& a : b.arms)
      s += fmt::format(
          "| {} | {:.1f} ({:.1f}-{:.1f}) | {} | {} | {} |\n", a.label, a.median_ms, a.p25_ms,
          a.p75_ms, a.compiled ? fmt::format("{:.3f}x", a.speedup) : std::string("-"),
          a.compiled ? std::to_string(a.nodes) : std::string("-"),
          a.compiled ? fmt::format("{:.1f}", a.arena_bytes / 1048576.0) : std::string("-"));
    s += fmt::format(
        "\nallocator peak of one step above what lives between steps: eager {:.1f} MiB, compiled "
        "{:.1f} MiB (arena included)\n",
        b.eager_peak_bytes / 1048576.0, b.compiled_peak_bytes / 1048576.0);
  }
  return s;
}

}  // namespace kuai::train
