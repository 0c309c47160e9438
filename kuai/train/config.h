// The run configuration: a TOML file plus `--section.key=value` command-line overrides. Every
// key is known and validated: an unknown key names the nearest valid one, a wrong type or range
// names what is allowed. Errors are ConfigError with a one-line message.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/nn/gpt.h"

namespace kuai::train {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrainConfig {
  nn::GPTConfig model;
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
  // [data]
  std::string data_source = "file";  // "file" | "synthetic"
  std::string data_path = "data/kjv.bin";
};

// Parse `toml_path` (may be empty: defaults only), then apply overrides of the form
// "--section.key=value" (or "section.key=value").
TrainConfig load_config(const std::string& toml_path, const std::vector<std::string>& overrides);

// The resolved configuration as TOML text.
std::string to_toml(const TrainConfig& cfg);

}  // namespace kuai::train
