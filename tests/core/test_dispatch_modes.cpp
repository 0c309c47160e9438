// Dispatch modes (kuai/core/dispatch.h): a mode on the thread's stack sees every op, outermost
// first, including the ops another mode dispatches (autocast's casts) and, unless it opts out,
// the ops of backward; the optimizers, gradient clipping and the fp16 loss scaler are ops like
// the others (in-place update primitives), so a mode sees a whole training step. And the core
// includes nothing from the layers above it (amp/, compile/).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kuai/amp/autocast.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/optim/sgd.h"

namespace kuai {
namespace {

Tensor randn(const Shape& shape, uint64_t seed, float std = 1.0f) {
  Tensor t = Tensor::empty(shape);
  Generator g(seed, 0);
  g.normal(t.data<float>(), t.numel(), 0.0f, std);
  return t;
}

// Records the name of every op it sees, and whether it was asked to transform or intercept.
class Recorder final : public DispatchMode {
 public:
  explicit Recorder(std::string tag, bool in_backward = true)
      : tag_(std::move(tag)), in_backward_(in_backward) {}
  void transform_inputs(const Primitive& p, std::vector<Tensor>&) override {
    seen.push_back(tag_ + ":" + std::string(p.name()));
  }
  bool intercept(const Primitive& p, std::span<const Tensor>, std::span<Tensor>) override {
    run.push_back(std::string(p.name()));
    return false;
  }
  bool applies_in_backward() const override { return in_backward_; }
  std::vector<std::string> seen, run;
  int count(const std::string& name) const {
    return static_cast<int>(std::count(run.begin(), run.end(), name));
  }

 private:
  std::string tag_;
  bool in_backward_;
};

TEST(DispatchModes, ModesSeeEveryOpOutermostFirstAndPopInOrder) {
  Recorder outer("outer"), inner("inner");
  const Tensor a = full({3}, 2.0f), b = full({3}, 3.0f);
  {
    ModeGuard g1(outer);
    {
      ModeGuard g2(inner);
      ASSERT_EQ(active_modes().size(), 2u);
      (void)add(a, b);
    }
    (void)mul(a, b);
  }
  EXPECT_TRUE(active_modes().empty());
  EXPECT_EQ(outer.seen, (std::vector<std::string>{"outer:add", "outer:mul"}));
  EXPECT_EQ(inner.seen, (std::vector<std::string>{"inner:add"}));
  // Seen in order: the outer mode's transform before the inner one's (one shared log).
  std::vector<std::string> log;
  class Logger final : public DispatchMode {
   public:
    Logger(std::vector<std::string>& log, std::string tag) : log_(log), tag_(std::move(tag)) {}
    void transform_inputs(const Primitive&, std::vector<Tensor>&) override { log_.push_back(tag_); }

   private:
    std::vector<std::string>& log_;
    std::string tag_;
  } l1(log, "first"), l2(log, "second");
  {
    ModeGuard g1(l1);
    ModeGuard g2(l2);
    (void)add(a, b);
  }
  EXPECT_EQ(log, (std::vector<std::string>{"first", "second"}));
}

// Autocast is a mode: a mode pushed outside it sees the casts autocast dispatches (a step captured
// under bf16 autocast records them) and the low-precision matmul; in backward autocast is off, and
// a mode that applies in backward sees the vjp ops while one that opts out does not.
TEST(DispatchModes, AutocastComposesWithAnOuterModeAndBackwardSkipsWhatOptsOut) {
  Recorder all("all"), forward_only("fwd", /*in_backward=*/false);
  Tensor w = randn({8, 8}, 1, 0.3f);
  w.requires_grad_();
  const Tensor x = randn({4, 8}, 2);
  {
    ModeGuard g1(all);
    ModeGuard g2(forward_only);
    amp::AutocastGuard amp(true, DType::kBF16);
    Tensor y = linear(x, w);
    EXPECT_EQ(y.dtype(), DType::kBF16);
    sum(cast(y, DType::kF32)).backward();
  }
  EXPECT_GE(all.count("cast"), 2) << "the casts of x and w";
  EXPECT_EQ(all.count("linear"), 1);
  const int fwd_cast = forward_only.count("cast");
  EXPECT_GE(all.count("cast"), fwd_cast);
  // Backward: the linear's vjp runs products (matmul) that only the mode applying in backward sees.
  EXPECT_GT(all.run.size(), forward_only.run.size());
  EXPECT_EQ(w.grad().dtype(), DType::kF32);
}

// The step after backward, under a mode: clipping, the fp16 scaler and the optimizer dispatch
// their primitives, one update per parameter, and the numbers are those without the mode.
TEST(DispatchModes, TheOptimizerClippingAndScalerAreOpsAModeSees) {
  auto make = [](uint64_t seed) {
    std::vector<Tensor> params = {randn({4, 4}, seed, 0.5f), randn({4}, seed + 1, 0.5f)};
    for (Tensor& p : params) {
      p.requires_grad_();
      p.set_grad(randn(p.shape(), seed + 7, 0.1f));
    }
    return params;
  };
  auto step = [](std::vector<Tensor>& params, bool sgd) {
    amp::GradScaler scaler;
    for (Tensor& p : params) p.set_grad(scale(p.grad(), scaler.scale()));
    const int64_t reads = host_reads_this_thread();  // from here on the host reads nothing
    const Tensor found_inf = scaler.unscale_(params);
    const Tensor factor = optim::clip_coefficient(optim::grad_norm_tensor(params), 0.05f);
    if (sgd) {
      optim::SGD opt({{params, 0.01f}}, {.lr = 0.1f, .momentum = 0.9f});
      scaler.step_on_device(opt, found_inf, factor);
    } else {
      optim::AdamW opt({{params, 0.01f}}, {});
      scaler.step_on_device(opt, found_inf, factor);
    }
    scaler.update(found_inf);
    EXPECT_EQ(host_reads_this_thread(), reads) << "sgd " << sgd;
  };
  for (bool sgd : {false, true}) {
    std::vector<Tensor> plain = make(3), seen = make(3);
    step(plain, sgd);
    Recorder r("r");
    {
      ModeGuard g(r);
      step(seen, sgd);
    }
    EXPECT_EQ(r.count("unscale_and_check"), 2);
    EXPECT_EQ(r.count("grad_norm"), 1);
    EXPECT_EQ(r.count("clip_coefficient"), 1);
    EXPECT_EQ(r.count(sgd ? "sgd_update" : "adamw_update"), 2);
    EXPECT_EQ(r.count("scaler_update"), 1);
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_EQ(plain[i].to_vector<float>(), seen[i].to_vector<float>()) << "sgd " << sgd;
  }
}

TEST(DispatchModes, AnInPlaceUpdateTakesItsWrittenInputsContiguousAndIsNotDifferentiable) {
  const Tensor p = zeros({4, 4}), g = full({4, 4}, 1.0f), m = zeros({4, 4}), v = zeros({4, 4});
  const Tensor hyper = from_vector(std::vector<float>{0.1f, 0.1f, 0.001f}, {3});
  try {
    adamw_update_(transpose(p, 0, 1), g, m, v, hyper, full({1}, 1.0f), zeros({1}), 0.9f, 0.999f,
                  1e-8f, 0);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("adamw_update: input 0 is written in place and must be "
                                         "contiguous"),
              std::string::npos)
        << e.what();
  }
  adamw_update_(p, transpose(g, 0, 1), m, v, hyper, full({1}, 1.0f), zeros({1}), 0.9f, 0.999f,
                1e-8f, 0);
  EXPECT_NE(p.to_vector<float>()[0], 0.0f);  // a strided read-only input is fine
  Tensor w = full({4}, 1.0f);
  w.requires_grad_();
  scale_(w, 2.0f);  // no autograd node for an update, even of a tensor that requires grad
  EXPECT_EQ(w.to_vector<float>(), std::vector<float>(4, 2.0f));
  EXPECT_TRUE(w.is_leaf());
}

// The core knows the layers above it only as modes: no file of kuai/core includes amp/ or compile/.
TEST(DispatchModes, TheCoreIncludesNothingFromAmpOrCompile) {
  namespace fs = std::filesystem;
  int files = 0;
  for (const auto& e : fs::directory_iterator(fs::path(KUAI_SOURCE_DIR) / "kuai" / "core")) {
    ++files;
    std::ifstream f(e.path());
    std::string line;
    for (int n = 1; std::getline(f, line); ++n)
      if (line.rfind("#include", 0) == 0) {
        EXPECT_TRUE(line.find("kuai/amp/") == std::string::npos &&
                    line.find("kuai/compile/") == std::string::npos)
            << e.path().filename() << ":" << n << ": " << line;
      }
  }
  EXPECT_GT(files, 10);
}

}  // namespace
}  // namespace kuai
