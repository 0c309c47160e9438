// The first training loop (see trainer.h).
#include "kuai/train/trainer.h"

#include <fmt/format.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/profiler.h"
#include "kuai/core/rng.h"
#include "kuai/data/token_file.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"

namespace kuai::train {

double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

double learning_rate(const TrainConfig& cfg, int64_t step) {
  if (cfg.warmup_steps > 0 && step < cfg.warmup_steps)
    return cfg.lr * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, cfg.steps - cfg.warmup_steps);
  const double progress = std::min(
      1.0, static_cast<double>(step - cfg.warmup_steps) / static_cast<double>(decay_steps));
  const double min_lr = cfg.lr * cfg.min_lr_ratio;
  return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

std::string result_line(const TrainResult& r) {
  return fmt::format(
      "RESULT tokens_per_s={:.1f} step_ms_median={:.2f} peak_rss_mib={:.1f} final_loss={:.4f}",
      r.tokens_per_s, r.step_ms_median, r.peak_rss_mib, r.final_loss);
}

std::vector<optim::ParamGroup> param_groups(const nn::Module& model, float weight_decay) {
  optim::ParamGroup decay{{}, weight_decay}, no_decay{{}, 0.0f};
  for (auto& [name, p] : model.named_parameters()) {
    const bool is_matmul_weight = p.dim() == 2 && name.ends_with(".weight") &&
                                  name.rfind("wte.", 0) != 0 && name.rfind("wpe.", 0) != 0;
    (is_matmul_weight ? decay : no_decay).params.push_back(p);
  }
  return {decay, no_decay};
}

TrainResult run_training(const TrainConfig& cfg, std::ostream& log) {
  if (cfg.threads > 0) omp_set_num_threads(static_cast<int>(cfg.threads));
  const int64_t B = cfg.batch_size, T = cfg.model.seq_len, V = cfg.model.vocab_size;

  std::optional<data::TokenFile> corpus;
  if (cfg.data_source == "file") {
    corpus.emplace(data::TokenFile::open(cfg.data_path));
    if (corpus->size() < T + 2)
      throw std::runtime_error(fmt::format("{}: {} tokens is fewer than model.seq_len + 2 = {}",
                                           cfg.data_path, corpus->size(), T + 2));
    if (corpus->vocab_bound() > V)
      throw std::runtime_error(fmt::format("{}: token ids reach {} but model.vocab_size is {}",
                                           cfg.data_path, corpus->vocab_bound() - 1, V));
  }

  nn::GPT model(cfg.model, static_cast<uint64_t>(cfg.seed));
  optim::AdamWOptions aopt;
  aopt.lr = static_cast<float>(cfg.lr);
  aopt.beta1 = static_cast<float>(cfg.beta1);
  aopt.beta2 = static_cast<float>(cfg.beta2);
  optim::AdamW opt(param_groups(model, static_cast<float>(cfg.weight_decay)), aopt);
  const std::vector<Tensor> params = model.parameters();

  log << fmt::format(
      "kuai train: GPT {} layers, {} heads, d_model {}, seq_len {}, vocab {} "
      "({:.2f}M parameters); batch {}, {} steps, {} threads, data {}\n",
      cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model, T, V,
      static_cast<double>(model.num_parameters()) / 1e6, B, cfg.steps, omp_get_max_threads(),
      cfg.data_source == "file" ? cfg.data_path : std::string("synthetic"));
  log.flush();

  Generator data_gen(static_cast<uint64_t>(cfg.seed), /*stream=*/2);
  Tensor x = Tensor::empty({B, T}, DType::kI32), y = Tensor::empty({B, T}, DType::kI32);
  std::vector<int32_t> window(T + 1);
  TrainResult result;
  for (int64_t step = 0; step < cfg.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    if (corpus) {
      std::vector<int32_t> starts(B);
      data_gen.randint(starts.data(), B, 0, static_cast<int32_t>(corpus->size() - T - 1));
      for (int64_t b = 0; b < B; ++b) {
        corpus->read(starts[b], T + 1, window.data());
        std::copy(window.begin(), window.begin() + T, x.data<int32_t>() + b * T);
        std::copy(window.begin() + 1, window.end(), y.data<int32_t>() + b * T);
      }
    } else {
      data_gen.randint(x.data<int32_t>(), B * T, 0, static_cast<int32_t>(V));
      data_gen.randint(y.data<int32_t>(), B * T, 0, static_cast<int32_t>(V));
    }
    opt.set_lr(static_cast<float>(learning_rate(cfg, step)));
    const auto t_data = std::chrono::steady_clock::now();
    Tensor loss = model.loss(x, y);
    const auto t_fwd = std::chrono::steady_clock::now();
    loss.backward();
    const auto t_bwd = std::chrono::steady_clock::now();
    const double norm = optim::grad_norm(params);
    opt.step(cfg.grad_clip > 0 ? optim::clip_coefficient(norm, static_cast<float>(cfg.grad_clip))
                               : 1.0f);
    opt.zero_grad();
    if (profiler::enabled()) {
      using ms = std::chrono::duration<double, std::milli>;
      profiler::record("[step] data", ms(t_data - t0).count());
      profiler::record("[step] forward", ms(t_fwd - t_data).count());
      profiler::record("[step] backward", ms(t_bwd - t_fwd).count());
      profiler::record("[step] optimizer", ms(std::chrono::steady_clock::now() - t_bwd).count());
    }
    const float loss_value = loss.item();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (step == 0 && profiler::enabled()) profiler::reset();  // profile the steady state
    result.losses.push_back(loss_value);
    result.step_ms.push_back(ms);
    if ((step + 1) % cfg.log_every == 0 || step == 0 || step + 1 == cfg.steps) {
      log << fmt::format(
          "step {:>5}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:.1f} ms | "
          "{:.0f} tok/s\n",
          step + 1, cfg.steps, loss_value, opt.lr(), norm, ms,
          static_cast<double>(B * T) / (ms / 1000.0));
      log.flush();
    }
  }
  std::vector<double> timed(result.step_ms.begin() + (result.step_ms.size() > 1 ? 1 : 0),
                            result.step_ms.end());
  if (!timed.empty()) {
    std::sort(timed.begin(), timed.end());
    const size_t n = timed.size();
    result.step_ms_median = n % 2 ? timed[n / 2] : 0.5 * (timed[n / 2 - 1] + timed[n / 2]);
    result.tokens_per_s = static_cast<double>(B * T) / (result.step_ms_median / 1000.0);
  }
  result.final_loss = result.losses.empty() ? 0.0f : result.losses.back();
  result.peak_rss_mib = peak_rss_mib();
  const MemoryStats mem = Allocator::get().stats();
  log << fmt::format(
      "memory: peak live tensors {:.1f} MiB, allocator reserved {:.1f} MiB, peak RSS {:.1f} MiB\n",
      static_cast<double>(mem.peak) / (1 << 20), static_cast<double>(mem.reserved) / (1 << 20),
      result.peak_rss_mib);
  if (profiler::enabled()) log << "profile (KUAI_PROFILE=1), steps 2..N:\n" << profiler::report();
  return result;
}

}  // namespace kuai::train
