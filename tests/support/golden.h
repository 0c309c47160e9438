// Test support for the whole-model golden tests against PyTorch fixtures (tests/golden/): the
// tolerance rules they share, stated once.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kuai/core/tensor.h"
#include "kuai/io/safetensors.h"
#include "kuai/io/tensor_io.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/train/trainer.h"

namespace kuai::test {

// |kuai - torch| <= rel * max|torch| + 1e-6 * |torch| per element: `rel` of the tensor's scale.
// The worst error relative to that scale is recorded as a test property named `what`.
inline void expect_close(const Tensor& got, const Tensor& want, const std::string& what,
                         double rel = 1e-5) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto g = got.contiguous().to_vector<float>(), w = want.to_vector<float>();
  double scale = 0, worst = 0;
  for (float v : w) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  for (size_t i = 0; i < g.size(); ++i) {
    const double err = std::fabs(static_cast<double>(g[i]) - w[i]);
    const double tol = rel * scale + 1e-6 * std::fabs(w[i]);
    worst = std::max(worst, err / (scale > 0 ? scale : 1.0));
    ASSERT_LE(err, tol) << what << " element " << i << ": kuai " << g[i] << " torch " << w[i];
  }
  ::testing::Test::RecordProperty(what, std::to_string(worst));
}

// An F64 tensor of the fixture as doubles.
inline std::vector<double> read_f64(const io::SafetensorsFile& file, const std::string& name) {
  const io::SafetensorsEntry* e = file.find(name);
  EXPECT_TRUE(e != nullptr && e->dtype == "F64") << name;
  if (e == nullptr) return {};
  const auto bytes = file.data(*e);
  std::vector<double> v(bytes.size() / sizeof(double));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(double));
  return v;
}

// The fixture's three AdamW steps on its one batch (its lr, betas, eps, weight decay with the
// usual grouping, global-norm clipping at grad_clip): each step's loss and gradient norm must be
// PyTorch's within 1e-5 relative.
inline void three_adamw_steps(nn::GPT& model, const io::SafetensorsFile& file) {
  auto md = [&](const char* k) { return std::stod(file.metadata().at(k)); };
  optim::AdamWOptions o;
  o.lr = static_cast<float>(md("lr"));
  o.beta1 = static_cast<float>(md("beta1"));
  o.beta2 = static_cast<float>(md("beta2"));
  o.eps = static_cast<float>(md("eps"));
  optim::AdamW opt(train::param_groups(model, static_cast<float>(md("weight_decay"))), o);
  const float clip = static_cast<float>(md("grad_clip"));
  const Tensor idx = io::read_tensor(file, "idx"), targets = io::read_tensor(file, "targets");
  const auto want_losses = io::read_tensor(file, "losses").to_vector<float>();
  const auto want_norms = io::read_tensor(file, "gradnorm").to_vector<float>();
  for (int step = 0; step < 3; ++step) {
    Tensor loss = model.loss(idx, targets, -1);
    loss.backward();
    const double norm = optim::grad_norm(model.parameters());
    EXPECT_NEAR(loss.item(), want_losses[step], 1e-5 * std::fabs(want_losses[step]));
    EXPECT_NEAR(norm, want_norms[step], 1e-5 * want_norms[step]);
    opt.step(optim::clip_coefficient(norm, clip));
    opt.zero_grad();
  }
}

// After the steps, against the float64 run (FlashAttention's acceptance rule): kuai's fp32 error
// at most twice PyTorch's fp32 error for the tensor, plus 1e-7 absolute (the fp32 rounding of the
// parameters). Returns kuai's error over (PyTorch's + 1e-7).
inline double expect_within_twice_torch(const std::string& name, const std::vector<float>& kuai32,
                                        const std::vector<float>& torch32,
                                        const std::vector<double>& exact) {
  EXPECT_EQ(kuai32.size(), exact.size()) << name;
  EXPECT_EQ(torch32.size(), exact.size()) << name;
  double err_torch = 0, err_kuai = 0;
  for (size_t i = 0; i < exact.size() && i < kuai32.size() && i < torch32.size(); ++i) {
    err_torch = std::max(err_torch, std::fabs(torch32[i] - exact[i]));
    err_kuai = std::max(err_kuai, std::fabs(kuai32[i] - exact[i]));
  }
  EXPECT_LE(err_kuai, 2 * err_torch + 1e-7)
      << name << ": kuai " << err_kuai << " torch " << err_torch;
  return err_kuai / (err_torch + 1e-7);
}

}  // namespace kuai::test
