// A training step of the tiny GPT for the compile tests (test_capture.cpp, test_replay.cpp): a
// model, AdamW and a loss scaler whose state persists across steps, and the step itself:
// micro-batches (loss / micro each, under autocast in bf16 and fp16), the scaler's unscale and
// overflow check, global-norm clipping at 1.0, AdamW, zero_grad.
#pragma once

#include <vector>

#include "kuai/amp/autocast.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/train/trainer.h"

namespace kuai::compiler::test {

inline nn::GPTConfig tiny() {
  nn::GPTConfig c;
  c.vocab_size = 61;
  c.n_layer = 2;
  c.n_head = 2;
  c.d_model = 32;
  c.seq_len = 16;
  return c;
}

// Model, optimizer and scaler of one trainer; the state persists across steps.
struct Trainer {
  Trainer(DType dtype)
      : model(tiny(), 3),
        opt(train::param_groups(model, 0.1f), {}),
        scaler([&] {
          amp::GradScalerOptions o;
          o.enabled = dtype == DType::kF16;
          return o;
        }()),
        dtype(dtype) {
    opt.ensure_state();
  }
  // One step on `batch` (x, y per micro-batch): the losses (one per micro-batch, / micro).
  std::vector<Tensor> step(const std::vector<Tensor>& batch) {
    const size_t micro = batch.size() / 2;
    std::vector<Tensor> losses;
    for (size_t m = 0; m < micro; ++m) {
      Tensor loss;
      {
        amp::AutocastGuard amp(dtype != DType::kF32, dtype == DType::kF32 ? DType::kBF16 : dtype);
        loss = scale(model.loss(batch[2 * m], batch[2 * m + 1]), 1.0f / static_cast<float>(micro));
      }
      mul(loss, scaler.scale_tensor()).backward();
      losses.push_back(loss);
    }
    const auto params = model.parameters();
    const Tensor found_inf = scaler.unscale_(params);
    const Tensor factor = optim::clip_coefficient(optim::grad_norm_tensor(params), 1.0f);
    scaler.step_on_device(opt, found_inf, factor);
    scaler.update(found_inf);
    opt.zero_grad();
    return losses;
  }
  std::vector<std::vector<float>> state() const {
    std::vector<std::vector<float>> s;
    for (const Tensor& p : model.parameters()) s.push_back(p.to_vector<float>());
    for (const auto& group : opt.exp_avg())
      for (const Tensor& m : group) s.push_back(m.to_vector<float>());
    for (const auto& group : opt.exp_avg_sq())
      for (const Tensor& v : group) s.push_back(v.to_vector<float>());
    return s;
  }
  nn::GPT model;
  optim::AdamW opt;
  amp::GradScaler scaler;
  DType dtype;
};

inline std::vector<Tensor> batch_of(int step, int micro) {
  Generator g(100 + static_cast<uint64_t>(step), 0);
  std::vector<Tensor> b;
  for (int m = 0; m < micro; ++m) {
    b.push_back(g.randint({4, 16}, 0, 61));
    b.push_back(g.randint({4, 16}, 0, 61));
  }
  return b;
}

}  // namespace kuai::compiler::test
