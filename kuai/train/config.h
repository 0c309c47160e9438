// The run configuration: a TOML file plus `--section.key=value` command-line overrides. Every
// key is known and validated: an unknown key names the nearest valid one, a wrong type or range
// names what is allowed. Errors are ConfigError with a one-line message.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kuai/nn/gpt.h"

namespace kuai::train {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrainConfig {
  // [run]
  std::string run_name;  // runs/<name>/; empty: the config file's stem, else "run"
  std::string run_dir = "runs";
  nn::GPTConfig model;
  // "naive" | "flash" | "auto": how attention runs (technique 6); flash and auto are applied to
  // the model by kuai::optimize (nn/optimize.h).
  std::string attention = "auto";
  // A Hugging Face LLaMA directory (model.safetensors + config.json, io/hf_llama.h) whose weights
  // a new run starts from (fine-tuning); its config.json must describe this model. Empty: the
  // family's initialisation. Not read on resume (the checkpoint has the weights).
  std::string init_hf;
  // [train]
  int64_t batch_size = 16;
  int64_t steps = 600;
  double lr = 1e-3;
  double min_lr_ratio = 0.1;  // cosine decay ends at lr * min_lr_ratio
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;  // 0 disables
  int64_t seed = 1337;
  int64_t threads = 0;  // 0: all cores
  int64_t log_every = 10;
  int64_t accum_steps = 1;  // micro-batches per optimizer step (technique 3)
  // "fp32" | "bf16" | "fp16": autocast compute dtype (technique 1); fp16 adds a loss scaler.
  std::string precision = "fp32";
  // Technique 4: capture the first step, replay its planned graph after (one process, no ZeRO).
  bool compile = false;
  std::string compile_memory = "arena";  // "arena" | "separate" (each buffer its own allocation)
  std::string compile_disable;  // passes switched off, comma-separated (kuai/compile/passes.h)
  // Activation recomputation (nn/checkpoint.h): "none" | "selective" | "full", over the first
  // recompute_layers blocks (-1: all).
  std::string recompute = "none";
  int64_t recompute_layers = -1;
  // Optimizer state offloaded to disk (optim/offloaded_moments.h): "none" | "disk". AdamW's
  // moments (ZeRO: this rank's shard) live in files under offload_dir (empty: <run>/offload),
  // one folder per rank, streamed through the update in chunks of offload_chunk_mb per file.
  std::string offload = "none";
  std::string offload_dir;
  int64_t offload_chunk_mb = 64;
  // With offload = disk and precision bf16|fp16: the fp32 master weights of the parameters only
  // products read (nn::Linear's) move into a third file too, and the model keeps them in the
  // compute dtype (optim/offload_adamw.h). Bit for bit the same run as without.
  bool offload_master = false;
  // fp16's dynamic loss scale (GradScaler's init_scale and growth_interval, PyTorch's defaults).
  double loss_scale = 65536.0;
  int64_t loss_scale_growth_interval = 2000;
  int64_t eval_every = 100;  // 0: no evaluation
  int64_t eval_batches = 8;
  // [data]
  std::string data_source = "file";  // "file" | "synthetic"
  std::string data_path = "data/kjv.bin";
  double val_fraction = 0.05;  // the held-out tail of the token file
  int64_t workers = 2;         // loader threads; 0: batches made on the training thread
  int64_t prefetch_factor = 2;
  double delay_ms = 0;  // artificial per-batch loader delay (benchmarks of prefetching)
  // [log]
  std::string progress = "auto";  // "auto" (bar on a terminal) | "bar" | "plain" | "off"
  bool jsonl = true;
  bool tensorboard = true;
  bool sync_every_step = false;  // read the loss on the host every step (the slow habit)
  bool save_weights = true;      // runs/<name>/model.safetensors at the end
  // [checkpoint]
  int64_t save_every = 0;            // full resumable checkpoint every N steps (0: only on SIGINT)
  int64_t export_every = 0;          // weights-only export every N steps (0: never)
  int64_t keep_last = 3;             // full checkpoints kept
  bool async_save = true;            // a writer thread writes while training continues
  std::string export_dtype = "f32";  // "f32" | "bf16"
  std::string on_save_error = "stop";  // "stop" | "continue"
  // [dist] (technique 2; used when launched by mpirun): DDP bucket sizes (MiB of fp32
  // gradients), overlap of the all-reduce with backward, unused parameters, the per-collective
  // deadline after which the run aborts with a message.
  double bucket_mb = 25.0;
  double first_bucket_mb = 1.0;
  bool overlap = true;
  bool find_unused = false;
  std::string compression = "none";  // "none" | "fp16" | "bf16" (technique 7)
  bool error_feedback = false;
  // ZeRO stage (technique 8): 1 AdamW state sharded, 2 gradients too, 3 parameters too
  // (distributed/zero3.h), gathered unit by unit: released after each unit's forward
  // (reshard_after_forward; false keeps them whole until backward is done) and gathered `prefetch`
  // units ahead. With accumulation ZeRO-3 reduce-scatters every micro-batch into the sharded
  // gradient (accumulate_sharded; false: whole gradients accumulate across the micro-batches and
  // only the last reduce-scatters, fewer bytes sent, a whole gradient held).
  int64_t zero = 0;
  bool reshard_after_forward = true;
  int64_t prefetch = 1;
  bool accumulate_sharded = true;
  // ZeRO-3 with autocast: the products' weights gathered in the compute dtype ("bf16" | "fp16",
  // = train.precision): half the bytes on the wire and whole; the fp32 shard stays the master.
  std::string gather_dtype = "fp32";
  double timeout_s = 300.0;
};

// Parse `toml_path` (may be empty: defaults only), then apply overrides of the form
// "--section.key=value" (or "section.key=value").
TrainConfig load_config(const std::string& toml_path, const std::vector<std::string>& overrides);

// The same from TOML text (`source` names it in errors); no file access. The fuzz target's entry.
TrainConfig load_config_text(std::string_view toml_text, const std::string& source,
                             const std::vector<std::string>& overrides = {});

// The resolved configuration as TOML text.
std::string to_toml(const TrainConfig& cfg);

}  // namespace kuai::train
