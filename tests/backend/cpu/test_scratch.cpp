// The kernels' scratch formulas (Primitive::cpu_scratch, backend/cpu/scratch.cpp: what the meta
// backend takes for a kernel, so `kuai plan`'s peak holds it) against the kernels: each op runs
// under a dispatch mode that evaluates it with a fresh allocator peak and records the bytes its
// kernel took besides its outputs, and what its formula states; they must be equal. Naive and flash
// attention forward and backward (fp32 and bf16, multi-head and grouped-query, T not a multiple of
// the blocks), low-precision cross-entropy and row sums.
#include <gtest/gtest.h>
#include <omp.h>

#include <map>

#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"

namespace kuai {
namespace {

// Evaluates every op itself and records the most scratch each primitive's kernel took.
class ScratchProbe final : public DispatchMode {
 public:
  bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override {
    if (p.is_view()) return false;
    Allocator& a = Allocator::get();
    a.empty_cache();  // fresh blocks: each allocation counts its rounded size, no more
    const int64_t before = a.stats().current;
    a.reset_peak();
    evaluate(p, in, out);
    int64_t& s = scratch[std::string(p.name())];
    s = std::max(s, a.stats().peak - before);
    int64_t stated = 0;
    for (int64_t b : p.cpu_scratch(in, std::span<const Tensor>(out.data(), out.size())))
      if (b > 0) stated += static_cast<int64_t>(Allocator::round_size(static_cast<size_t>(b)));
    int64_t& f = formula[std::string(p.name())];
    f = std::max(f, stated);
    return true;
  }
  std::map<std::string, int64_t> scratch, formula;
};

Tensor random(const Shape& shape, DType dtype, uint64_t seed) {
  Generator g(seed, 0);
  const Tensor x = g.normal(shape, 0.0f, 0.5f);
  return dtype == DType::kF32 ? x : cast(x, dtype);
}

struct AttentionCase {
  bool flash;
  DType dtype;
  int64_t B, H, Hkv, T, d;
};

TEST(ScratchModel, AttentionForwardAndBackwardTakeWhatTheFormulasSay) {
  const int threads = omp_get_max_threads();
  for (const AttentionCase& c : {AttentionCase{false, DType::kF32, 2, 4, 4, 200, 32},
                                 AttentionCase{false, DType::kBF16, 2, 4, 2, 130, 32},
                                 AttentionCase{true, DType::kF32, 2, 4, 2, 200, 32},
                                 AttentionCase{true, DType::kBF16, 1, 4, 4, 300, 64},
                                 AttentionCase{true, DType::kF32, 3, 8, 8, 64, 16}}) {
    const Tensor qkv = random({c.B, c.T, c.H + 2 * c.Hkv, c.d}, c.dtype, 1).detach();
    Tensor leaf = qkv;
    leaf.requires_grad_(true);
    ScratchProbe probe;
    {
      ModeGuard guard(probe);
      std::vector<Tensor> parts = split(leaf, {c.H, c.Hkv, c.Hkv}, 2);
      for (Tensor& t : parts) t = transpose(t, 1, 2);
      const Tensor y = c.flash ? flash_attention(parts[0], parts[1], parts[2], true)
                               : scaled_dot_product_attention(parts[0], parts[1], parts[2], true);
      autograd::backward(y, random(y.shape(), c.dtype, 2));
    }
    const std::string fwd = c.flash ? "flash_attention" : "attention";
    const std::string what = ::testing::PrintToString(
        std::vector<int64_t>{c.flash, c.dtype == DType::kF32, c.B, c.H, c.Hkv, c.T, c.d});
    // fp32 products inside the kernels take oneDNN's own scratch on the worker threads, and so do
    // bf16 ones where they run on oneDNN (the amx tier: gemm_lowp.h); the formula is the kernel's
    // buffers, so the measured scratch is at least it and not much more.
    const int64_t f = probe.formula[fwd], b = probe.formula[fwd + "_backward"];
    EXPECT_GT(f, 0) << what;
    EXPECT_GT(b, 0) << what;
    const bool onednn_products =
        c.dtype == DType::kF32 || cpu::lowp_gemm_auto_path() == cpu::LowpGemmPath::kOneDNN;
    const int64_t slack = onednn_products ? threads * (int64_t{160} << 10) : 0;
    EXPECT_GE(probe.scratch[fwd], f) << what;
    EXPECT_LE(probe.scratch[fwd], f + slack) << what;
    EXPECT_GE(probe.scratch[fwd + "_backward"], b) << what;
    EXPECT_LE(probe.scratch[fwd + "_backward"], b + slack) << what;
  }
}

TEST(ScratchModel, LowPrecisionCrossEntropyAndRowSums) {
  for (auto [R, V] : {std::pair<int64_t, int64_t>{300, 1000}, {40, 70000}, {7, 256}}) {
    Tensor logits = random({R, V}, DType::kBF16, 3).detach();
    logits.requires_grad_(true);
    Generator g(4, 0);
    const Tensor targets = g.randint({R}, 0, static_cast<int32_t>(V));
    ScratchProbe probe;
    {
      ModeGuard guard(probe);
      cross_entropy(logits, targets).backward();
    }
    EXPECT_GT(probe.formula["cross_entropy"], 0);
    EXPECT_EQ(probe.scratch["cross_entropy"], probe.formula["cross_entropy"]) << R << " x " << V;
    EXPECT_EQ(probe.scratch["cross_entropy_backward"], probe.formula["cross_entropy_backward"])
        << R << " x " << V;
  }
  for (auto [rows, inner] : {std::pair<int64_t, int64_t>{5000, 96}, {300, 768}, {100, 48}}) {
    const Tensor x = random({rows, inner}, DType::kBF16, 5);
    ScratchProbe probe;
    {
      ModeGuard guard(probe);
      (void)sum(x, 0);
    }
    EXPECT_GT(probe.formula["sum"], 0);
    EXPECT_EQ(probe.scratch["sum"], probe.formula["sum"]) << rows << " x " << inner;
  }
  // fp32 logits and sums take none, and say so.
  Tensor logits = random({100, 50}, DType::kF32, 6).detach();
  logits.requires_grad_(true);
  Generator g(7, 0);
  ScratchProbe probe;
  {
    ModeGuard guard(probe);
    cross_entropy(logits, g.randint({100}, 0, 50)).backward();
    (void)sum(random({300, 96}, DType::kF32, 8), 0);
  }
  for (const char* op : {"cross_entropy", "cross_entropy_backward", "sum"}) {
    EXPECT_EQ(probe.formula[op], 0) << op;
    EXPECT_EQ(probe.scratch[op], 0) << op;
  }
}

}  // namespace
}  // namespace kuai
