// The first training loop: a GPT on a token file (random windows) or on synthetic tokens, with
// AdamW (decay on matmul weights only), linear warmup + cosine decay, global-norm clipping
// folded into the optimizer pass. Reports per-step times and ends with a summary.
#pragma once

#include <functional>
#include <ostream>
#include <vector>

#include "kuai/optim/optimizer.h"
#include "kuai/train/config.h"

namespace kuai::train {

struct TrainResult {
  std::vector<float> losses;    // per step
  std::vector<double> step_ms;  // per step
  double tokens_per_s = 0;      // from the median step time (first step excluded)
  double step_ms_median = 0;
  double peak_rss_mib = 0;
  float final_loss = 0;
};

// The usual AdamW grouping: weight decay on matmul weights (2-D ".weight" outside the
// embeddings), none on biases, LayerNorm and embeddings.
std::vector<optim::ParamGroup> param_groups(const nn::Module& model, float weight_decay);

// Learning rate at `step` (0-based): linear warmup, then cosine decay to lr * min_lr_ratio.
double learning_rate(const TrainConfig& cfg, int64_t step);

TrainResult run_training(const TrainConfig& cfg, std::ostream& log);

// The line every run ends with: "RESULT tokens_per_s=... step_ms_median=... peak_rss_mib=...
// final_loss=...".
std::string result_line(const TrainResult& r);

double peak_rss_mib();

}  // namespace kuai::train
