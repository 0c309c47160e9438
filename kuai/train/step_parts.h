// What a run's training step is made of, built from its config the one way `kuai train` builds
// it: the model (attention replaced as model.attention asks), DDP over several ranks, AdamW or
// ZeRO's sharded AdamW (either with its moments offloaded to disk under train.offload = disk),
// the loss scaler and the TrainStep over them. `kuai plan` builds the same
// parts on meta tensors (under DeviceGuard(kMeta), with a recording process group) and runs the
// step they make, so a technique added here is planned without being described twice.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "kuai/amp/grad_scaler.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/zero.h"
#include "kuai/distributed/zero3.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/offload_adamw.h"
#include "kuai/train/config.h"
#include "kuai/train/train_step.h"

namespace kuai::train {

struct StepParts {
  std::shared_ptr<nn::Module> model;  // the trained module (a GPT when built from a config)
  std::optional<dist::DistributedDataParallel> ddp;
  std::unique_ptr<optim::AdamW> adamw;               // or
  std::unique_ptr<optim::OffloadedAdamW> offloaded;  // AdamW over moments on disk, or
  std::unique_ptr<dist::ZeroAdamW> zero;             // ZeRO's sharded AdamW (dist.zero > 0)
  // ZeRO-3: the parameters sharded over the model's units (the model's unit hooks).
  std::unique_ptr<dist::ShardedParameters> sharded;
  std::unique_ptr<amp::GradScaler> scaler;
  std::unique_ptr<TrainStep> step;
  optim::Optimizer& optimizer() {
    if (zero) return *zero;
    if (offloaded) return *offloaded;
    return *adamw;
  }
};

// AdamW's two groups: 2-D matmul weights decay, embeddings, norms and biases do not.
std::vector<optim::ParamGroup> param_groups(const nn::Module& model, float weight_decay);

// Where rank `rank` keeps its offloaded optimizer state: train.offload_dir, or the run
// directory's offload/ folder, then rank<r>/.
std::string offload_dir(const TrainConfig& cfg, int rank);

// The step's options from the config (no log callback).
StepOptions step_options(const TrainConfig& cfg);

// The parts of cfg's step on `group`'s ranks, on the default device. `loaded` runs on the model
// right after it is built (weights to load before DDP broadcasts rank 0's); with ZeRO-3 the model
// is built on meta and has no values to load into: `init_hf` (a Hugging Face LLaMA directory)
// then gives each rank's shards their values one parameter at a time (io::HfReader) instead of
// the seed.
std::unique_ptr<StepParts> build_step_parts(const TrainConfig& cfg,
                                            std::shared_ptr<dist::ProcessGroup> group,
                                            const StepOptions& options,
                                            const std::function<void(nn::GPT&)>& loaded = {},
                                            const std::string& init_hf = {});

}  // namespace kuai::train
