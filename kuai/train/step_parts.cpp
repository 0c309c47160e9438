// A run's step parts from its config (see step_parts.h).
#include "kuai/train/step_parts.h"

#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <optional>

#include "kuai/amp/autocast.h"
#include "kuai/core/autograd.h"
#include "kuai/core/device.h"
#include "kuai/core/ops.h"
#include "kuai/io/hf_llama.h"
#include "kuai/nn/layers.h"
#include "kuai/nn/optimize.h"

namespace kuai::train {

std::vector<optim::ParamGroup> param_groups(const nn::Module& model, float weight_decay) {
  optim::ParamGroup decay{{}, weight_decay}, no_decay{{}, 0.0f};
  for (auto& [name, p] : model.named_parameters()) {
    // Embedding tables (GPT-2's wte and wpe, LLaMA's embed_tokens) are lookups: no decay.
    const bool is_matmul_weight = p.dim() == 2 && name.ends_with(".weight") &&
                                  name.rfind("wte.", 0) != 0 && name.rfind("wpe.", 0) != 0 &&
                                  name.rfind("embed_tokens.", 0) != 0;
    (is_matmul_weight ? decay : no_decay).params.push_back(p);
  }
  return {decay, no_decay};
}

std::string offload_dir(const TrainConfig& cfg, int rank) {
  const std::filesystem::path base =
      cfg.offload_dir.empty() ? std::filesystem::path(cfg.run_dir) / cfg.run_name / "offload"
                              : std::filesystem::path(cfg.offload_dir);
  return (base / fmt::format("rank{}", rank)).string();
}

StepOptions step_options(const TrainConfig& cfg) {
  StepOptions so;
  so.accum_steps = cfg.accum_steps;
  so.compute = amp::precision_dtype(cfg.precision);
  so.grad_clip = static_cast<float>(cfg.grad_clip);
  so.compile = cfg.compile;
  so.passes = compiler::PassOptions::all_but(cfg.compile_disable);
  so.executable.memory = cfg.compile_memory == "separate"
                             ? compiler::ExecutableOptions::Memory::kSeparate
                             : compiler::ExecutableOptions::Memory::kArena;
  return so;
}

std::unique_ptr<StepParts> build_step_parts(const TrainConfig& cfg,
                                            std::shared_ptr<dist::ProcessGroup> group,
                                            const StepOptions& options,
                                            const std::function<void(nn::GPT&)>& loaded,
                                            const std::string& init_hf) {
  auto parts = std::make_unique<StepParts>();
  std::shared_ptr<nn::GPT> gpt;
  // ZeRO-3 builds the model on meta (shapes, no bytes): each rank fills its shards from the seed
  // one parameter at a time (nn::GPT::initial_values), so no rank ever holds the whole model, not
  // even at the start; fine-tuning from Hugging Face's files (init_hf) reads them so too.
  const bool zero3 = cfg.zero == 3;
  const bool on_meta = zero3 && default_device().type != DeviceType::kMeta;
  std::optional<io::HfReader> hf;
  if (on_meta && !init_hf.empty()) {
    hf.emplace(init_hf);
    hf->check_describes(cfg.model);
  }
  {
    const MemoryUseScope params(MemoryUse::kParameters);
    std::optional<DeviceGuard> meta;
    if (on_meta) meta.emplace(kMeta);
    gpt = std::make_shared<nn::GPT>(cfg.model, static_cast<uint64_t>(cfg.seed));
  }
  parts->model = gpt;
  if (loaded) loaded(*gpt);
  optimize(*gpt, nn::parse_attention_impl(cfg.attention));  // kuai::optimize: built naive
  gpt->set_recompute(nn::parse_recompute(cfg.recompute), cfg.recompute_layers);
  optim::AdamWOptions aopt;
  aopt.lr = static_cast<float>(cfg.lr);
  aopt.beta1 = static_cast<float>(cfg.beta1);
  aopt.beta2 = static_cast<float>(cfg.beta2);
  // ZeRO (technique 8): the same AdamW with its moments sharded across the ranks over DDP's
  // buckets (stage 1), and the gradients too (stage 2: DDP reduce-scatters into the shards), and
  // the parameters too (stage 3: distributed/zero3.h). Alone there is nothing to shard, and stage
  // 2 runs as stage 1.
  // Offload (technique 8's other half): the moments, or ZeRO's shard of them, in files of this
  // rank's, streamed through the update.
  const auto groups = param_groups(*gpt, static_cast<float>(cfg.weight_decay));
  std::optional<optim::OffloadOptions> offload;
  if (cfg.offload == "disk")
    offload = optim::OffloadOptions{offload_dir(cfg, group->rank()), cfg.offload_chunk_mb << 20};
  // train.offload_master: the products' parameters become working copies in the compute dtype,
  // their fp32 masters in the offload files, made from rank 0's fp32 weights before DDP allocates
  // its gradient buckets (the fp32 model and the buckets are never resident together; DDP's own
  // broadcast then sends the working copies, equal on every rank).
  // Under ZeRO the working copies are made by ZeroAdamW, after DDP (its buckets are the layout).
  if (offload && cfg.offload_master) {
    offload->master_params = nn::product_parameters(*gpt);
    offload->master_dtype = options.compute;
  }
  if (offload && cfg.offload_master && cfg.zero == 0) {
    if (group->size() > 1) {
      std::vector<std::shared_ptr<dist::Work>> works;
      for (const Tensor& p : gpt->parameters()) works.push_back(group->broadcast(p, 0));
      for (auto& w : works) w->wait();
    }
    parts->offloaded = std::make_unique<optim::OffloadedAdamW>(groups, aopt, *offload);
  }
  // DDP (README, technique 2): rank 0's weights everywhere, gradients averaged during backward.
  // ZeRO-3 (also on one rank, where it shards over one): one bucket per unit, in backward order,
  // each reduce-scattered into the gradient shard as soon as its unit's backward is done.
  // dist.gather_dtype: the products' weights gathered in the compute dtype (a bucket of their own
  // per unit).
  const std::vector<Tensor> low =
      zero3 && cfg.gather_dtype != "fp32" ? nn::product_parameters(*gpt) : std::vector<Tensor>{};
  if (group->size() > 1 || zero3) {
    dist::DDPOptions dopt;
    dopt.bucket_mb = cfg.bucket_mb;
    dopt.first_bucket_mb = cfg.first_bucket_mb;
    dopt.overlap = cfg.overlap;
    dopt.find_unused = cfg.find_unused;
    dopt.compression = dist::parse_compression(cfg.compression);
    dopt.error_feedback = cfg.error_feedback;
    dopt.sharded = (cfg.zero >= 2 && group->size() > 1) || zero3;  // stage 2 runs as 1 alone
    dopt.broadcast = !on_meta;  // every rank makes the same shards from the seed
    parts->ddp.emplace(*gpt, group, dopt,
                       zero3 ? dist::ShardedParameters::bucket_layout(gpt->units(), low)
                             : std::vector<std::vector<Tensor>>{});
  }
  if (cfg.zero > 0) {
    parts->zero = std::make_unique<dist::ZeroAdamW>(
        groups, aopt, group,
        parts->ddp ? parts->ddp->bucket_params() : std::vector<std::vector<Tensor>>{},
        parts->ddp ? static_cast<int>(cfg.zero) : 1, int64_t{1} << 22, offload);
    if (parts->zero->stage() >= 2)
      parts->ddp->shard_gradients(parts->zero->gradient_shards(), zero3 && cfg.accumulate_sharded);
    if (on_meta) {  // this rank's elements of each parameter, made one parameter at a time
      std::map<const TensorImpl*, std::string> names;
      for (const auto& [name, p] : gpt->named_parameters()) names[p.impl()] = name;
      const autograd::NoGradGuard no_grad;
      parts->zero->fill_parameter_shard([&](const Tensor& p, int64_t begin, const Tensor& dst) {
        Tensor whole;
        if (hf) {
          whole = hf->parameter(names.at(p.impl()));
        } else {
          whole = Tensor::empty(p.shape(), DType::kF32, dst.device());
          gpt->initial_values(names.at(p.impl()), whole);
        }
        dst.copy_(narrow(reshape(whole, {p.numel()}), 0, begin, dst.numel()));
      });
    }
    if (zero3) {  // the parameters now live in the shards; the model gathers them unit by unit
      parts->sharded = std::make_unique<dist::ShardedParameters>(
          gpt->units(), *parts->zero,
          dist::Zero3Options{cfg.reshard_after_forward, static_cast<int>(cfg.prefetch),
                             amp::precision_dtype(cfg.gather_dtype)},
          low);
      gpt->set_unit_hooks(parts->sharded.get());
    }
  } else if (offload) {
    if (!parts->offloaded)
      parts->offloaded = std::make_unique<optim::OffloadedAdamW>(groups, aopt, *offload);
  } else {
    parts->adamw = std::make_unique<optim::AdamW>(groups, aopt);
  }
  // fp16 needs a dynamic loss scale; fp32 and bf16 run the same calls with it disabled.
  amp::GradScalerOptions sopt;
  sopt.enabled = options.compute == DType::kF16;
  sopt.init_scale = static_cast<float>(cfg.loss_scale);
  sopt.growth_interval = cfg.loss_scale_growth_interval;
  parts->scaler = std::make_unique<amp::GradScaler>(sopt);
  nn::GPT* m = gpt.get();
  parts->step = std::make_unique<TrainStep>(
      *gpt, [m](const Tensor& x, const Tensor& y) { return m->loss(x, y); }, parts->optimizer(),
      *parts->scaler, options, parts->ddp ? &*parts->ddp : nullptr, parts->zero.get());
  return parts;
}

}  // namespace kuai::train
