// The device seam (kuai/core/backend.h): the layers above the backends include none of them;
// tensors move between devices with to() and copy_(); creation ops carry their device; meta
// tensors have shapes and no bytes, and the allocator accounts them as it does CPU memory; host
// access to tensor bytes throws off the host and counts as a host read inside a step.
#include <gtest/gtest.h>

#include <omp.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/core/backend.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/train/train_step.h"
#include "kuai/train/trainer.h"

namespace kuai {
namespace {

// No file of the engine above the backends includes one: they reach a device only through
// core/backend.h. kuai/plan among them: it runs the step on meta tensors and times ops through
// evaluate(), which dispatches to the CPU backend.
TEST(Backend, TheLayersAboveIncludeNoBackend) {
  namespace fs = std::filesystem;
  int files = 0;
  for (const char* dir : {"core", "nn", "optim", "amp", "compile", "distributed", "plan"}) {
    for (const auto& e :
         fs::recursive_directory_iterator(fs::path(KUAI_SOURCE_DIR) / "kuai" / dir)) {
      if (!e.is_regular_file()) continue;
      ++files;
      std::ifstream f(e.path());
      std::string line;
      for (int n = 1; std::getline(f, line); ++n) {
        if (line.rfind("#include", 0) != 0) continue;
        EXPECT_EQ(line.find("kuai/backend"), std::string::npos)
            << dir << "/" << e.path().filename().string() << ":" << n << ": " << line;
      }
    }
  }
  EXPECT_GT(files, 50);
  EXPECT_FALSE(fs::exists(fs::path(KUAI_SOURCE_DIR) / "kuai" / "dist"));
}

TEST(Backend, CpuAndMetaAreRegisteredAndSayWhatTheyAre) {
  EXPECT_TRUE(backend_available(DeviceType::kCPU));
  EXPECT_TRUE(backend_available(DeviceType::kMeta));
  EXPECT_EQ(backend_for(kCPU).describe().rfind("cpu: ", 0), 0u) << backend_for(kCPU).describe();
  EXPECT_TRUE(backend_for(kCPU).host_accessible());
  EXPECT_FALSE(backend_for(kMeta).host_accessible());
  EXPECT_FALSE(backend_for(kMeta).has_bytes());
  if (!backend_available(DeviceType::kCUDA)) {
    try {
      (void)zeros({2}, DType::kF32, Device{DeviceType::kCUDA, 0});
      ADD_FAILURE() << "a CUDA tensor without a CUDA backend";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("cuda:0"), std::string::npos) << e.what();
    }
  }
}

TEST(Backend, CreationOpsCarryTheirDevice) {
  for (Device d : {kCPU, kMeta}) {
    Generator g(1, 2);
    for (const Tensor& t : {zeros({2, 3}, DType::kBF16, d), full({4}, 2.5f, DType::kF32, d),
                            arange(5, DType::kF32, d), g.normal({3, 3}, 0.0f, 1.0f, d),
                            g.uniform({7}, -1.0f, 1.0f, d), g.randint({2, 2}, 0, 9, d),
                            from_vector(std::vector<float>{1, 2, 3}, {3}, d)})
      EXPECT_EQ(t.device(), d) << t.str();
  }
  // The same draws on the CPU whether made as a tensor or into a buffer.
  Generator a(5, 1), b(5, 1);
  std::vector<float> host(10);
  b.normal(host.data(), 10, 0.0f, 2.0f);
  EXPECT_EQ(a.normal({10}, 0.0f, 2.0f).to_vector<float>(), host);
  EXPECT_EQ(a.offset(), b.offset());
  EXPECT_EQ(arange(4).to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(arange(3, DType::kF32).to_vector<float>(), (std::vector<float>{0, 1, 2}));
}

TEST(Backend, ToAndCopyMoveValuesBetweenDevices) {
  const Tensor x = from_vector(std::vector<float>{1, -2, 3, 4, 5, 6}, {2, 3});
  EXPECT_TRUE(x.to(kCPU).is_same(x));
  const Tensor m = x.to(kMeta);
  EXPECT_EQ(m.device(), kMeta);
  EXPECT_EQ(m.shape(), x.shape());
  EXPECT_EQ(m.dtype(), x.dtype());
  // A transposed view copies as its elements in order.
  Tensor y = Tensor::empty({3, 2});
  y.copy_(transpose(x, 0, 1));
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1, 4, -2, 5, 3, 6}));
  EXPECT_THROW(y.copy_(x), std::invalid_argument);  // shapes differ
  // Meta tensors have no bytes: reading them on the host is an error that names the device.
  for (auto read : {+[](const Tensor& t) { (void)t.data<float>(); },
                    +[](const Tensor& t) { (void)t.to_vector<float>(); },
                    +[](const Tensor& t) { (void)t.to(kCPU); },
                    +[](const Tensor& t) { (void)sum(t).item(); }}) {
    try {
      read(m);
      ADD_FAILURE() << "read a meta tensor on the host";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("meta"), std::string::npos) << e.what();
    }
  }
}

// The same allocations on the CPU and on meta tensors: the allocator counts them alike (rounded
// sizes, cached blocks reused), so a step run on meta tensors has the CPU step's peak.
TEST(Backend, TheAllocatorAccountsMetaTensorsAsCpuOnes) {
  auto churn = [](Device d) {
    Allocator& a = Allocator::get();
    a.empty_cache(d);
    const int64_t base = a.stats(d).current;
    a.reset_peak(d);
    std::vector<int64_t> live;
    {
      std::vector<Tensor> keep;
      for (int64_t n : {100, 3000, 1 << 18, 77, 1 << 21, 5000}) {
        keep.push_back(Tensor::empty({n}, DType::kF32, d));
        if (n == 3000) keep.erase(keep.begin());  // a freed block, reused below if it fits
        live.push_back(a.stats(d).current - base);
      }
      keep.push_back(Tensor::empty({90}, DType::kBF16, d));
      live.push_back(a.stats(d).current - base);
    }
    live.push_back(a.stats(d).peak - base);
    live.push_back(a.stats(d).current - base);
    return live;
  };
  EXPECT_EQ(churn(kMeta), churn(kCPU));
}

// A transformer block's ops, forward and backward, on meta tensors: no bytes anywhere, the
// gradients' shapes and devices right.
TEST(Backend, ABlocksForwardAndBackwardRunOnMetaTensors) {
  Generator g(3, 0);
  const Tensor x = g.normal({2, 16, 32}, 0.0f, 1.0f, kMeta).requires_grad_(true);
  const Tensor w = g.normal({32, 96}, 0.0f, 1.0f, kMeta).requires_grad_(true);
  const Tensor h =
      layer_norm(x, full({32}, 1.0f, DType::kF32, kMeta), zeros({32}, DType::kF32, kMeta), 1e-5f);
  const Tensor qkv = matmul(h, w);
  std::vector<Tensor> parts = chunk(reshape(qkv, {2, 16, 6, 16}), 3, 2);
  for (Tensor& p : parts) p = transpose(p, 1, 2);
  const Tensor y = scaled_dot_product_attention(parts[0], parts[1], parts[2], true);
  const Tensor loss = mean(gelu(y));
  EXPECT_EQ(loss.device(), kMeta);
  loss.backward();
  EXPECT_EQ(x.grad().shape(), x.shape());
  EXPECT_EQ(x.grad().device(), kMeta);
  EXPECT_EQ(w.grad().shape(), w.shape());
}

// Host access to tensor bytes counts as a host read inside a step, on the stepping thread, and
// nowhere else; writes through copy_() and copy_from_host() are not reads.
TEST(Backend, HostAccessInsideAStepIsAHostRead) {
  const Tensor t = full({4}, 1.0f);
  const int64_t r0 = host_reads_this_thread();
  (void)t.to_vector<float>();
  (void)t.data<float>();
  EXPECT_EQ(host_reads_this_thread(), r0);  // setup, checkpoint I/O: not counted
  {
    StepScope step;
    (void)t.to_vector<float>();
    EXPECT_EQ(host_reads_this_thread(), r0 + 1);
    (void)t.data<float>();
    EXPECT_EQ(host_reads_this_thread(), r0 + 2);
    float v = 3.0f;
    t.copy_(full({4}, 2.0f));
    Tensor(t).copy_from_host(std::vector<float>(4, v).data(), 4 * sizeof(float));
    EXPECT_EQ(host_reads_this_thread(), r0 + 2);
    int64_t other = -1;
    std::thread([&] {
      (void)t.to_vector<float>();  // not this thread's step
      other = host_reads_this_thread();
    }).join();
    EXPECT_EQ(other, 0);
  }
  EXPECT_EQ(narrow(t, 0, 2, 1).contiguous().item_as<float>(), 3.0f);  // counted anywhere
  EXPECT_EQ(host_reads_this_thread(), r0 + 3);
}

}  // namespace
}  // namespace kuai

namespace kuai::train {
namespace {

// A small GPT-2 or LLaMA, its AdamW and (disabled) scaler, and a TrainStep of 2 micro-batches over
// them, all built on the current default device (DeviceGuard), with B x T batches for it.
struct StepRig {
  static nn::GPTConfig config(const char* family, int64_t vocab, int64_t layers, int64_t T) {
    nn::GPTConfig c;
    c.family = family;
    c.vocab_size = vocab;
    c.n_layer = layers;
    c.n_head = 4;
    c.n_kv_head = std::string(family) == "llama" ? 2 : 0;
    c.d_model = 64;
    c.seq_len = T;
    return c;
  }
  static StepOptions options(DType compute) {
    StepOptions o;
    o.accum_steps = 2;
    o.compute = compute;
    return o;
  }
  StepRig(const char* family, int64_t vocab, int64_t layers, int64_t T, DType compute)
      : cfg(config(family, vocab, layers, T)),
        model(cfg, 3),
        opt(param_groups(model, 0.1f), optim::AdamWOptions{}),
        scaler(amp::GradScalerOptions{65536.0f, 2.0f, 0.5f, 2000, false}),
        step(
            model, [this](const Tensor& x, const Tensor& y) { return model.loss(x, y); }, opt,
            scaler, options(compute)) {}
  std::vector<data::Batch> batches(int64_t B) const {
    Generator g(9, 0);
    std::vector<data::Batch> b;
    const auto V = static_cast<int32_t>(cfg.vocab_size);
    for (int64_t i = 0; i < step.options().accum_steps; ++i)
      b.push_back({g.randint({B, cfg.seq_len}, 0, V), g.randint({B, cfg.seq_len}, 0, V)});
    return b;
  }
  nn::GPTConfig cfg;
  nn::GPT model;
  optim::AdamW opt;
  amp::GradScaler scaler;
  TrainStep step;
};

// The real training step on meta tensors: a GPT-2 and a LLaMA built under DeviceGuard(kMeta)
// (parameters, AdamW's moments, the scaler's scale all there) through TrainStep, with autocast
// and accumulation. No bytes anywhere; the allocator's peak for the meta device against the CPU
// run of the same step: lower by at most the kernels' scratch, which the meta backend does not
// run (its share depends on the tier: about 1-5% of this tiny step at amx, 12% at avx2).
TEST(MetaStep, AGptAndALlamaTrainStepRunOnMetaTensors) {
  for (const char* family : {"gpt2", "llama"}) {
    for (DType compute : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string(family) + " " + std::string(dtype_name(compute)));
      auto peak_of = [&](Device d) {
        Allocator& a = Allocator::get();
        a.empty_cache(d);
        const int64_t base = a.stats(d).current;
        a.reset_peak(d);
        DeviceGuard on(d);
        StepRig rig(family, 64, 2, 32, compute);
        const std::vector<data::Batch> b = rig.batches(2);
        StepOutputs out;
        for (int s = 0; s < 2; ++s) out = rig.step.step(b);
        EXPECT_EQ(out.loss.device(), d);
        EXPECT_EQ(out.grad_norm.device(), d);
        for (const Tensor& p : rig.model.parameters()) EXPECT_EQ(p.device(), d);
        return a.stats(d).peak - base;
      };
      ScratchRegion::reset_peak();
      const int64_t cpu = peak_of(kCPU);
      // Kernel scratch: the most this thread held at once, on each of the kernels' threads.
      const int64_t scratch = ScratchRegion::peak() * omp_get_max_threads();
      const int64_t meta = peak_of(kMeta);
      std::printf("[ meta     ] %s %s: step peak cpu %lld B, meta %lld B, scratch %lld B\n", family,
                  std::string(dtype_name(compute)).c_str(), static_cast<long long>(cpu),
                  static_cast<long long>(meta), static_cast<long long>(scratch));
      EXPECT_GT(meta, 0);
      EXPECT_LE(meta, cpu);
      EXPECT_GE(meta, cpu - scratch) << "scratch bound " << scratch;
    }
  }
}

// Sums every primitive's cost, by class.
class CostTally final : public DispatchMode {
 public:
  bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override {
    const Cost c = p.cost(in, std::span<const Tensor>(out.data(), out.size()));
    (p.op_class() == OpClass::kMatmul      ? matmul_flops
     : p.op_class() == OpClass::kAttention ? attention_flops
                                           : other_flops) += c.flops;
    bytes += c.bytes_read + c.bytes_written;
    return false;
  }
  double matmul_flops = 0, attention_flops = 0, other_flops = 0;
  int64_t bytes = 0;
};

// The costs of a real step on meta tensors are the textbook count: 6 FLOPs per matmul weight per
// token (forward 2, backward 4), and attention's 12 per causal query-key pair and head dimension
// (forward 4, backward 8), per layer.
TEST(MetaStep, TheStepsCostsOnMetaAreTheTextbookCount) {
  for (const char* family : {"gpt2", "llama"}) {
    SCOPED_TRACE(family);
    DeviceGuard on(kMeta);
    StepRig rig(family, 96, 3, 24, DType::kF32);
    const int64_t B = 3, T = 24;
    const std::vector<data::Batch> b = rig.batches(B);
    CostTally tally;
    {
      ModeGuard guard(tally);
      rig.step.step(b);
    }
    const nn::GPTConfig& cfg = rig.cfg;
    double weights = 0;
    for (auto& [name, p] : rig.model.named_parameters())
      if (p.dim() == 2 && name != "wpe.weight" &&
          !(name == "embed_tokens.weight" && !rig.model.config().tied()))
        weights += static_cast<double>(p.numel());
    const int64_t k = rig.step.options().accum_steps;
    const double tokens = static_cast<double>(B * T * k);
    EXPECT_EQ(tally.matmul_flops, 6.0 * tokens * weights);
    const double pairs = static_cast<double>(B) * cfg.n_head * (T * (T + 1) / 2);
    EXPECT_EQ(tally.attention_flops, 12.0 * pairs * (cfg.d_model / cfg.n_head) * cfg.n_layer * k);
    EXPECT_EQ(tally.other_flops, 0.0);
    EXPECT_GT(tally.bytes, 0);
  }
}

}  // namespace
}  // namespace kuai::train
