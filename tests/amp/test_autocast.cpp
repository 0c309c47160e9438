// Autocast: the policy table (which op runs in which dtype), the per-step parameter cast cache,
// gradients through the casts into fp32 master weights, backward without autocast, and that a
// tiny GPT trained in bf16 or fp16 tracks fp32.
#include <gtest/gtest.h>

#include <cmath>

#include "kuai/amp/autocast.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"

namespace kuai::test {
namespace {

Tensor randn(const Shape& shape, uint64_t seed, float std = 1.0f) {
  Tensor t = Tensor::empty(shape);
  Generator g(seed, 0);
  g.normal(t.data<float>(), t.numel(), 0.0f, std);
  return t;
}

TEST(Autocast, PolicyTable) {
  Tensor x = randn({4, 8}, 1), w = randn({6, 8}, 2), b = randn({6}, 3);
  Tensor ln_w = full({6}, 1.0f), ln_b = zeros({6});
  for (DType low : {DType::kBF16, DType::kF16}) {
    amp::AutocastGuard guard(true, low);
    Tensor y = linear(x, w, b);
    EXPECT_EQ(y.dtype(), low) << "linear runs in the low dtype";
    EXPECT_EQ(matmul(x, transpose(w, 0, 1)).dtype(), low);
    EXPECT_EQ(layer_norm(y, ln_w, ln_b).dtype(), DType::kF32) << "layer_norm in fp32";
    EXPECT_EQ(softmax(y).dtype(), DType::kF32) << "softmax in fp32";
    EXPECT_EQ(sum(y, 0).dtype(), DType::kF32) << "reductions in fp32";
    EXPECT_EQ(gelu(y).dtype(), low) << "elementwise ops keep their input's dtype";
    EXPECT_EQ(add(y, zeros({4, 6})).dtype(), DType::kF32) << "mixed inputs promote to fp32";
    EXPECT_EQ(cross_entropy(y, from_vector(std::vector<int32_t>{0, 1, 2, 3}, {4})).dtype(),
              DType::kF32);
  }
  EXPECT_EQ(linear(x, w, b).dtype(), DType::kF32) << "off outside the guard";
}

TEST(Autocast, ParametersAreCastOncePerGuardAndGetFp32Gradients) {
  Tensor w = randn({8, 8}, 4, 0.3f);
  w.requires_grad_();
  Tensor x = randn({5, 8}, 5);
  Tensor ref_grad;
  {  // fp32: the same graph without autocast
    sum(linear(linear(x, w), w)).backward();
    ref_grad = w.grad().clone();
    w.set_grad(Tensor());
  }
  amp::reset_autocast_param_casts();
  {
    amp::AutocastGuard guard(true, DType::kBF16);
    Tensor y = linear(linear(x, w), w);  // w used twice: cast once
    EXPECT_EQ(amp::autocast_param_casts(), 1);
    bool autocast_in_backward = true;
    w.register_hook([&](const Tensor&) { autocast_in_backward = amp::autocast_enabled(); });
    sum(cast(y, DType::kF32)).backward();
    EXPECT_FALSE(autocast_in_backward) << "backward runs with autocast off";
  }
  {
    amp::AutocastGuard guard(true, DType::kBF16);  // a new step casts again
    (void)linear(x, w);
    EXPECT_EQ(amp::autocast_param_casts(), 2);
  }
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), DType::kF32) << "the master weight's gradient is fp32";
  // bf16 keeps 8 significant bits; a chain of two products and their gradients stays within a
  // few percent of the fp32 result in relative norm.
  const auto g = w.grad().to_vector<float>(), r = ref_grad.to_vector<float>();
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  EXPECT_LT(std::sqrt(num / den), 3e-2);
  EXPECT_GT(std::sqrt(num / den), 0.0) << "bf16 arithmetic actually ran";
}

// A weight's cast is made in the first micro-batch of a step and reused by the later ones. Its
// node (and the weight's AccumulateGrad) get fresh sequence numbers on reuse, so in a later
// micro-batch each low-precision weight gradient is cast and added to the fp32 gradient right
// after its product's backward, as in the first micro-batch, instead of all of them waiting until
// the end of backward (2 bytes per parameter more at the peak: what kuai plan found). Measured:
// the second micro-batch's backward holds at most a couple of weights' gradients at once.
TEST(Autocast, ReusedWeightCastsRunRightAfterTheirConsumers) {
  nn::GPTConfig c;
  c.vocab_size = 64;
  c.n_layer = 4;
  c.n_head = 4;
  c.d_model = 256;
  c.seq_len = 4;
  const nn::GPT model(c, 3);
  Generator gen(9, 0);
  const Tensor x = gen.randint({1, 4}, 0, 64), y = gen.randint({1, 4}, 0, 64);
  int64_t largest = 0, total = 0;
  for (const auto& [name, p] : model.named_parameters()) {
    largest = std::max(largest, p.numel());
    total += p.numel();
  }
  Allocator& a = Allocator::get();
  amp::AutocastGuard guard(true, DType::kBF16);
  std::vector<int64_t> held;  // the most each micro-batch's backward added to what was live
  for (int micro = 0; micro < 2; ++micro) {
    const Tensor loss = model.loss(x, y);
    const int64_t before = a.stats().current;
    a.reset_peak();
    loss.backward();
    held.push_back(a.stats().peak - before);
  }
  // The first backward makes the fp32 gradients (4 bytes a parameter); the second adds into them
  // and holds a weight's bf16 and fp32 gradients at a time (plus the activations' gradients).
  EXPECT_GT(held[0], 4 * total);
  EXPECT_LT(held[1], 2 * 6 * largest + (int64_t{256} << 10))
      << "the second micro-batch held " << held[1] << " bytes; all bf16 weight gradients are "
      << 2 * total;
}

// Each low-precision op equals its fp32 evaluation on the widened inputs, rounded once: at most
// half an ulp of the low dtype apart (plus fp32 noise, as the fast and plain fp32 paths may
// differ in summation order).
void expect_rounded_once(const Tensor& low, const Tensor& f32, DType t, const char* what) {
  const auto a = cast(low, DType::kF32).to_vector<float>();
  const auto b = f32.to_vector<float>();
  ASSERT_EQ(a.size(), b.size());
  const double ulp = t == DType::kBF16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
  for (size_t i = 0; i < a.size(); ++i)
    ASSERT_LE(std::abs(a[i] - b[i]),
              0.5 * ulp * std::abs(b[i]) * 1.0001 + 1e-6 * (1 + std::abs(b[i])))
        << what << " element " << i << ": " << a[i] << " vs " << b[i];
}

TEST(Autocast, LowPrecisionKernelsRoundOnce) {
  for (DType t : {DType::kBF16, DType::kF16}) {
    // Odd sizes: vector tails, blocks that do not divide.
    Tensor x = cast(randn({37, 29}, 6), t), w = cast(randn({13, 29}, 7, 0.2f), t),
           b = cast(randn({13}, 8), t), y = cast(randn({37, 29}, 9), t);
    auto f32 = [](const Tensor& u) { return cast(u, DType::kF32); };
    expect_rounded_once(linear(x, w, b), linear(f32(x), f32(w), f32(b)), t, "linear");
    expect_rounded_once(matmul(x, transpose(w, 0, 1)), matmul(f32(x), transpose(f32(w), 0, 1)), t,
                        "matmul");
    expect_rounded_once(gelu(x), gelu(f32(x)), t, "gelu");
    expect_rounded_once(gelu_backward(x, y), gelu_backward(f32(x), f32(y)), t, "gelu_backward");
    expect_rounded_once(add(x, y), add(f32(x), f32(y)), t, "add");
    expect_rounded_once(mul(x, y), mul(f32(x), f32(y)), t, "mul");
    expect_rounded_once(scale(x, 0.37f), scale(f32(x), 0.37f), t, "scale");
    expect_rounded_once(sum(x, 0), sum(f32(x), 0), t, "sum");
    Tensor q = cast(randn({2, 3, 19, 8}, 10), t), k = cast(randn({2, 3, 19, 8}, 11), t),
           v = cast(randn({2, 3, 19, 8}, 12), t);
    // Where the CPU multiplies bf16 natively, the probabilities are rounded to bf16 before p v
    // (as FlashAttention does: cpu::gemm_lowp_round_a), so y is the rounding of exactly that.
    // Both policies, whatever the CPU: the tier's, then rounding forced on.
    for (bool force : {false, true}) {
      if (force) cpu::set_lowp_rounds_a(true);
      Tensor ref = scaled_dot_product_attention(f32(q), f32(k), f32(v), true);
      if (cpu::lowp_rounds_a(t)) {
        const Tensor p = softmax(matmul(f32(q), transpose(f32(k), 2, 3)), 1.0f / std::sqrt(8.0f),
                                 /*causal=*/true);
        ref = matmul(f32(cast(p, t)), f32(v));
      }
      const Tensor got = scaled_dot_product_attention(q, k, v, true);
      cpu::reset_lowp_rounds_a();
      expect_rounded_once(got, ref, t, force ? "attention (probabilities rounded)" : "attention");
    }
    // Cross-entropy on low-precision logits: fp32 arithmetic, so the loss equals the fp32 one
    // on the same (widened) logits to fp32 accuracy, and the gradient is rounded once.
    Tensor logits = cast(randn({37, 300}, 13, 3.0f), t);
    Tensor targets = Tensor::empty({37}, DType::kI32);
    for (int i = 0; i < 37; ++i) targets.data<int32_t>()[i] = (i * 31) % 300;
    Tensor l32 = f32(logits);
    l32.requires_grad_();
    Tensor lo = logits.detach();
    lo.requires_grad_();
    Tensor loss32 = cross_entropy(l32, targets), losslo = cross_entropy(lo, targets);
    EXPECT_EQ(losslo.dtype(), DType::kF32);
    EXPECT_NEAR(losslo.item(), loss32.item(), 1e-6 * std::abs(loss32.item()));
    loss32.backward();
    losslo.backward();
    EXPECT_EQ(lo.grad().dtype(), t);
    expect_rounded_once(lo.grad(), l32.grad(), t, "cross_entropy backward");
  }
}

TEST(Autocast, LlamaOpsRoundOnce) {
  // SiLU, the SwiGLU gate, RoPE and their backwards on bf16 / f16 storage compute in fp32 and
  // round once: bit for bit the fp32 op on the widened inputs, rounded. Odd sizes (vector tails).
  for (DType t : {DType::kBF16, DType::kF16}) {
    auto f32 = [](const Tensor& u) { return cast(u, DType::kF32); };
    Tensor h = cast(randn({5, 3, 2 * 37}, 30, 3.0f), t), dy = cast(randn({5, 3, 37}, 31), t);
    expect_rounded_once(silu(h), silu(f32(h)), t, "silu");
    expect_rounded_once(swiglu(h), swiglu(f32(h)), t, "swiglu");
    Tensor hl = h.detach(), h32 = f32(h).detach();
    hl.requires_grad_();
    h32.requires_grad_();
    swiglu(hl).backward(dy);
    swiglu(h32).backward(f32(dy));
    expect_rounded_once(hl.grad(), h32.grad(), t, "swiglu backward");
    Tensor x = cast(randn({2, 7, 5, 10}, 32), t);
    expect_rounded_once(rope(x, 10000.0, 3, 4), rope(f32(x), 10000.0, 3, 4), t, "rope");
  }
}

TEST(Autocast, GroupedQueryAttentionIsMultiHeadOverRepeatedKeysBitForBit) {
  // Grouped-query attention against multi-head attention over k and v repeated per query head, in
  // fp32, bf16 and f16, naive and flash: the same output and dq bit for bit, and each key/value
  // head's gradient is the fp32 sum, in head order, of its query heads' gradients there, rounded
  // once to the dtype (each part already in the dtype, as PyTorch's repeat_kv backward has them).
  const int64_t B = 2, H = 6, Hkv = 2, G = H / Hkv, T = 37, d = 8;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16})
    for (bool flash : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + (flash ? " flash" : " naive"));
      auto att = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
        return flash ? flash_attention(q, k, v, true) : scaled_dot_product_attention(q, k, v, true);
      };
      Tensor q = cast(randn({B, H, T, d}, 40), t).detach(),
             k = cast(randn({B, Hkv, T, d}, 41), t).detach(),
             v = cast(randn({B, Hkv, T, d}, 42), t).detach();
      const Tensor dy = cast(randn({B, H, T, d}, 43), t);
      std::vector<Tensor> kr, vr;  // (B, 1, T, d) per query head
      for (int64_t h = 0; h < H; ++h) {
        kr.push_back(narrow(k, 1, h / G, 1));
        vr.push_back(narrow(v, 1, h / G, 1));
      }
      Tensor k_rep = contiguous(cat(kr, 1)).detach(), v_rep = contiguous(cat(vr, 1)).detach();
      Tensor q2 = q.detach();
      for (Tensor* u : {&q, &k, &v, &q2, &k_rep, &v_rep}) u->requires_grad_();
      Tensor y = att(q, k, v), y_rep = att(q2, k_rep, v_rep);
      auto values = [](const Tensor& u) {
        return cast(u, DType::kF32).contiguous().to_vector<float>();
      };
      EXPECT_EQ(values(y), values(y_rep));
      y.backward(dy);
      y_rep.backward(dy);
      EXPECT_EQ(values(q.grad()), values(q2.grad()));
      for (auto [got, rep] :
           {std::pair{k.grad(), k_rep.grad()}, std::pair{v.grad(), v_rep.grad()}}) {
        const auto parts = cast(rep, DType::kF32).contiguous().to_vector<float>();  // (B, H, T, d)
        std::vector<float> sum(static_cast<size_t>(B * Hkv * T * d), 0.0f);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t j = 0; j < Hkv; ++j)
            for (int64_t g = 0; g < G; ++g)
              for (int64_t e = 0; e < T * d; ++e)
                sum[((b * Hkv + j) * T) * d + e] += parts[((b * H + j * G + g) * T) * d + e];
        const Tensor want = cast(from_vector(sum, {B, Hkv, T, d}), t);
        EXPECT_EQ(cast(got, DType::kF32).contiguous().to_vector<float>(),
                  cast(want, DType::kF32).to_vector<float>());
      }
    }
}

TEST(Autocast, AttentionBackwardMatchesFp32OnSameInputs) {
  // The fused attention's backward in bf16 reads bf16 probabilities; against the fp32 backward on
  // the widened inputs it differs by the rounding of p, dy and the outputs: a relative norm well
  // under 1%.
  Tensor q = cast(randn({2, 2, 33, 16}, 20), DType::kBF16),
         k = cast(randn({2, 2, 33, 16}, 21), DType::kBF16),
         v = cast(randn({2, 2, 33, 16}, 22), DType::kBF16);
  Tensor dy = randn({2, 2, 33, 16}, 23);
  auto grads = [&](DType t) {
    Tensor a = cast(q, t).detach(), b = cast(k, t).detach(), c = cast(v, t).detach();
    for (Tensor* u : {&a, &b, &c}) u->requires_grad_();
    Tensor y = scaled_dot_product_attention(a, b, c, true);
    y.backward(cast(dy, t));
    return std::vector<Tensor>{cast(a.grad(), DType::kF32), cast(b.grad(), DType::kF32),
                               cast(c.grad(), DType::kF32)};
  };
  const auto lo = grads(DType::kBF16), hi = grads(DType::kF32);
  for (int i = 0; i < 3; ++i) {
    const auto a = lo[i].to_vector<float>(), b = hi[i].to_vector<float>();
    double num = 0, den = 0;
    for (size_t j = 0; j < a.size(); ++j) {
      num += (a[j] - b[j]) * (a[j] - b[j]);
      den += b[j] * b[j];
    }
    EXPECT_LT(std::sqrt(num / den), 1e-2) << "gradient " << i;
  }
}

nn::GPTConfig tiny_config() {
  nn::GPTConfig cfg;
  cfg.vocab_size = 64;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.d_model = 32;
  cfg.seq_len = 32;
  return cfg;
}

void fill_batch(Tensor& x, Tensor& y, int64_t step) {
  // A learnable pattern: token t is followed by (3t + 1) mod 64, with a position-dependent start.
  const int64_t B = x.size(0), T = x.size(1);
  for (int64_t b = 0; b < B; ++b) {
    int32_t tok = static_cast<int32_t>((b * 7 + step * 13) % 64);
    for (int64_t t = 0; t < T; ++t) {
      x.data<int32_t>()[b * T + t] = tok;
      tok = (3 * tok + 1) % 64;
      y.data<int32_t>()[b * T + t] = tok;
    }
  }
}

// Trains the tiny GPT for `steps` AdamW steps in `precision`; returns the losses.
std::vector<float> train_tiny(DType precision, int steps) {
  nn::GPT model(tiny_config(), 42);
  optim::AdamWOptions o;
  o.lr = 3e-3f;
  optim::AdamW opt({{model.parameters(), 0.0f}}, o);
  amp::GradScalerOptions so;
  so.enabled = precision == DType::kF16;
  amp::GradScaler scaler(so);
  Tensor x = Tensor::empty({8, 32}, DType::kI32), y = Tensor::empty({8, 32}, DType::kI32);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    fill_batch(x, y, s);
    {
      amp::AutocastGuard guard(precision != DType::kF32,
                               precision == DType::kF32 ? DType::kBF16 : precision);
      Tensor loss = model.loss(x, y);
      losses.push_back(loss.item());
      scale(loss, scaler.scale()).backward();
    }
    Tensor inf = scaler.unscale_(model.parameters());
    scaler.step(opt, inf, full({}, 1.0f));
    scaler.update(inf);
    opt.zero_grad();
  }
  return losses;
}

TEST(Autocast, TinyGptTrainsInBf16AndFp16LikeFp32) {
  // 60 steps take the loss from ln(64) = 4.16 to well under 1. Tolerance: the mean loss of the
  // last 10 steps within 0.05 (absolute) of fp32's; measured differences are ~1e-2 for bf16 and
  // ~1e-3 for fp16 (10 and 13 significant bits).
  const int steps = 60;
  const auto f32 = train_tiny(DType::kF32, steps);
  auto tail = [&](const std::vector<float>& l) {
    double s = 0;
    for (int i = steps - 10; i < steps; ++i) s += l[i];
    return s / 10;
  };
  ASSERT_LT(tail(f32), 1.0) << "fp32 learns the pattern";
  for (DType t : {DType::kBF16, DType::kF16}) {
    const auto low = train_tiny(t, steps);
    EXPECT_NEAR(low[0], f32[0], 0.02) << dtype_name(t) << ": first loss";
    EXPECT_NEAR(tail(low), tail(f32), 0.05) << dtype_name(t);
    std::printf("%s: first %.4f (fp32 %.4f), last-10 mean %.4f (fp32 %.4f)\n",
                std::string(dtype_name(t)).c_str(), low[0], f32[0], tail(low), tail(f32));
  }
}

TEST(Autocast, ActivationsAreSavedInTheLowDtype) {
  // Allocator bytes held after the forward (what backward will read): bf16 keeps everything but
  // the fp32 residual stream (LayerNorm inputs) in 2 bytes, so at most 0.65x of fp32 (measured
  // 0.57x at this shape).
  nn::GPTConfig cfg;
  cfg.vocab_size = 256;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.d_model = 128;
  cfg.seq_len = 128;
  nn::GPT model(cfg, 1);
  Tensor x = Tensor::empty({8, 128}, DType::kI32), y = Tensor::empty({8, 128}, DType::kI32);
  for (int64_t i = 0; i < x.numel(); ++i) {
    x.data<int32_t>()[i] = static_cast<int32_t>(i % 251);
    y.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % 256);
  }
  auto held_after_forward = [&](bool low) {
    const int64_t base = Allocator::get().stats().current;
    amp::AutocastGuard guard(low, DType::kBF16);
    Tensor loss = model.loss(x, y);
    return Allocator::get().stats().current - base;
  };
  const double f32 = static_cast<double>(held_after_forward(false));
  const double bf16 = static_cast<double>(held_after_forward(true));
  EXPECT_LT(bf16, 0.65 * f32) << bf16 / f32;
}

}  // namespace
}  // namespace kuai::test
