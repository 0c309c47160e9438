// Whole-model golden test against PyTorch (fixture written by tests/golden/make_golden.py with
// Debian's python3-torch): a 2-layer GPT with the fixture's weights must reproduce PyTorch's
// logits, loss and every gradient, and the parameters after 3 AdamW steps with global-norm
// clipping (0.8: the first two steps clip, the third does not) and the usual weight-decay
// grouping. Tolerance: fp32 both sides, different summation orders; logits, loss and gradients
// must satisfy |kuai - torch| <= 1e-5 * max|torch| + 1e-6 * |torch| per tensor, i.e. 1e-5
// relative to the tensor's scale; the parameters after the steps are judged against a float64
// run of the same steps (reason below).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "kuai/core/ops.h"
#include "kuai/io/tensor_io.h"
#include "kuai/nn/gpt.h"
#include "kuai/nn/optimize.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/train/trainer.h"

namespace kuai {
namespace {

const std::string kFixture = std::string(KUAI_SOURCE_DIR) + "/tests/golden/tiny_gpt.safetensors";

void expect_close(const Tensor& got, const Tensor& want, const std::string& what,
                  double rel = 1e-5) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto g = got.to_vector<float>(), w = want.to_vector<float>();
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

struct Golden {
  io::SafetensorsFile file = io::SafetensorsFile::open(kFixture);
  nn::GPTConfig cfg;
  Golden() {
    auto meta = [&](const char* k) { return std::stoll(file.metadata().at(k)); };
    cfg.vocab_size = meta("vocab_size");
    cfg.n_layer = meta("n_layer");
    cfg.n_head = meta("n_head");
    cfg.d_model = meta("d_model");
    cfg.seq_len = meta("seq_len");
  }
  double md(const char* k) const { return std::stod(file.metadata().at(k)); }
  Tensor t(const std::string& name) const { return io::read_tensor(file, name); }
  std::vector<double> f64(const std::string& name) const {
    const io::SafetensorsEntry* e = file.find(name);
    EXPECT_TRUE(e != nullptr && e->dtype == "F64") << name;
    const auto bytes = file.data(*e);
    std::vector<double> v(bytes.size() / sizeof(double));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(double));
    return v;
  }
  void load_into(nn::GPT& model) const {
    std::map<std::string, Tensor> state;
    for (auto& [name, p] : model.named_parameters()) state[name] = t("param." + name);
    model.load_state_dict(state);
  }
};

// Naive and flash attention (kuai::optimize) against the same fixture, the same tolerance.
class GPTGoldenAttention : public ::testing::TestWithParam<nn::AttentionImpl> {};

TEST_P(GPTGoldenAttention, ForwardLogitsLossAndGradientsMatchPyTorch) {
  Golden g;
  nn::GPT model(g.cfg, 0);
  g.load_into(model);
  optimize(model, GetParam());
  Tensor idx = g.t("idx"), targets = g.t("targets");
  expect_close(model.forward(idx), g.t("logits"), "logits");
  Tensor loss = model.loss(idx, targets, -1);
  expect_close(reshape(loss, {1}), g.t("loss"), "loss");
  loss.backward();
  for (auto& [name, p] : model.named_parameters())
    expect_close(p.grad(), g.t("grad." + name), "grad." + name);
}

INSTANTIATE_TEST_SUITE_P(Impl, GPTGoldenAttention,
                         ::testing::Values(nn::AttentionImpl::kNaive, nn::AttentionImpl::kFlash),
                         [](const auto& info) { return nn::attention_impl_name(info.param); });

TEST(GPTGolden, ThreeAdamWStepsWithClippingMatchPyTorch) {
  Golden g;
  nn::GPT model(g.cfg, 0);
  g.load_into(model);
  optim::AdamWOptions o;
  o.lr = static_cast<float>(g.md("lr"));
  o.beta1 = static_cast<float>(g.md("beta1"));
  o.beta2 = static_cast<float>(g.md("beta2"));
  o.eps = static_cast<float>(g.md("eps"));
  optim::AdamW opt(train::param_groups(model, static_cast<float>(g.md("weight_decay"))), o);
  const float clip = static_cast<float>(g.md("grad_clip"));
  Tensor idx = g.t("idx"), targets = g.t("targets");
  const auto want_losses = g.t("losses").to_vector<float>();
  const auto want_norms = g.t("gradnorm").to_vector<float>();
  for (int step = 0; step < 3; ++step) {
    Tensor loss = model.loss(idx, targets, -1);
    loss.backward();
    const double norm = optim::grad_norm(model.parameters());
    EXPECT_NEAR(loss.item(), want_losses[step], 1e-5 * std::fabs(want_losses[step]));
    EXPECT_NEAR(norm, want_norms[step], 1e-5 * want_norms[step]);
    opt.step(optim::clip_coefficient(norm, clip));
    opt.zero_grad();
  }
  // After three steps, compare against the float64 run (FlashAttention's acceptance rule):
  // kuai's fp32 error must be at most twice PyTorch's fp32 error, tensor by tensor (plus 1e-7
  // absolute, the fp32 rounding of the parameters). The fixture uses eps = 1e-6: with 1e-8 a
  // few gradients that cancel to the fp32 noise floor (-2.6e-9 against a maximum of 1e-2, off
  // by a few percent in either implementation) become updates of ~lr/5 whose error is luck, and
  // the difference spreads through every later gradient. eps = 1e-6 keeps those updates small.
  double worst_ratio = 0;
  for (auto& [name, p] : model.named_parameters()) {
    const std::vector<double> exact = g.f64("step3_f64." + name);
    const auto torch32 = g.t("step3." + name).to_vector<float>();
    const auto kuai32 = p.to_vector<float>();
    double err_torch = 0, err_kuai = 0;
    for (size_t i = 0; i < exact.size(); ++i) {
      err_torch = std::max(err_torch, std::fabs(torch32[i] - exact[i]));
      err_kuai = std::max(err_kuai, std::fabs(kuai32[i] - exact[i]));
    }
    EXPECT_LE(err_kuai, 2 * err_torch + 1e-7)
        << name << ": kuai " << err_kuai << " torch " << err_torch;
    worst_ratio = std::max(worst_ratio, err_kuai / (err_torch + 1e-7));
  }
  ::testing::Test::RecordProperty("worst_error_ratio_vs_torch", std::to_string(worst_ratio));
}

}  // namespace
}  // namespace kuai
