// `kuai plan`: what a training run will need and how fast it will go, predicted before it starts
// from the model's shapes (plan/step_model.h replays one step through a model of the allocator)
// and this machine's measured costs (plan/costs.h: each product's GEMM rate and scratch through
// the router and its tuning cache, attention's kernels, the memory bandwidth, the per-op
// overhead) plus the link's latency and bandwidth (measured by `kuai bench ddp`, or given).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kuai/plan/costs.h"
#include "kuai/plan/step_model.h"
#include "kuai/train/config.h"

namespace kuai::plan {

// The step a config runs with `ranks` processes and `threads` OpenMP threads per process.
StepSpec step_spec(const train::TrainConfig& cfg, int64_t ranks, int threads);

// A collective costs latency + bytes / bandwidth per ring step: an all-reduce of b bytes over N
// ranks 2(N-1)/N b / bandwidth + 2(N-1) latency, a reduce-scatter or all-gather half of that.
struct Link {
  double bandwidth_gbs = 0;  // per rank, GB/s (1e9 bytes)
  double latency_us = 0;
  std::string source;  // "measured by kuai bench ddp (file)", "--bandwidth", "assumed"
  double seconds(const std::string& op, double bytes, int64_t ranks) const;
};
// The link `kuai bench ddp` measured on this machine (link_file()), if any.
std::optional<Link> measured_link();
std::string link_file();  // ${XDG_CACHE_HOME:-$HOME/.cache}/kuai/link.json
void save_link(const Link& link);

struct TimePrediction {
  double products_s = 0;      // the step's products at their measured rates
  double attention_s = 0;     // attention's kernels
  double memory_s = 0;        // memory-bound passes at the measured bandwidth
  double overhead_s = 0;      // dispatching the step's ops
  double comm_s = 0;          // the collectives, end to end
  double comm_exposed_s = 0;  // what backward does not hide (bucketed all-reduce overlap)
  double step_s = 0;
  double tokens_per_s = 0;  // over all ranks
  double flops = 0;         // products + attention, per rank and step
};

struct Prediction {
  StepSpec spec;
  StepModel step;
  TimePrediction time;
  int64_t budget_bytes = 0;
  bool fits() const { return step.peak_bytes <= budget_bytes; }
};

// Predicts `cfg` on `ranks` ranks (step model + time); `costs` is filled with what it measures
// (shapes already there are not measured again).
Prediction predict(const train::TrainConfig& cfg, int64_t ranks, int64_t budget_bytes,
                   const Link& link, MachineCosts& costs);
TimePrediction predict_time(const StepSpec& spec, const StepModel& step, const MachineCosts& costs,
                            const Link& link, bool overlap);

struct ScalingRow {
  int64_t ranks = 1;
  double tokens_per_s = 0, efficiency = 0, step_ms = 0, comm_exposed_ms = 0;
  int64_t peak_bytes = 0;
};
// The config at 1, 2, 8, 64, 512 ranks, the batch per rank unchanged.
std::vector<ScalingRow> scaling(const train::TrainConfig& cfg, const Link& link,
                                MachineCosts& costs, const std::vector<int64_t>& ranks);

// A change set that makes the config fit: its overrides and its prediction.
struct FitOption {
  std::vector<std::string> overrides;  // "--train.batch_size=4", ...
  int64_t ranks = 1;
  int64_t peak_bytes = 0;
  double step_s = 0, tokens_per_s = 0;
  // A ready `kuai train` line: the config, the overrides the plan was given, then the changes.
  std::string command(const std::string& config_path,
                      const std::vector<std::string>& given = {}) const;
};
// Options within `budget_bytes` (with `headroom` of it spare), those on `ranks` ranks first, then
// each larger rank count, fastest first within each: fewer micro-batch
// rows with more accumulation (the same batch), bf16, flash attention, ZeRO-1/2, up to 64x the
// ranks with the global batch unchanged.
std::vector<FitOption> fit(const train::TrainConfig& cfg, int64_t ranks, int64_t budget_bytes,
                           const Link& link, MachineCosts& costs, double headroom = 0.05);

// The readable plan: the memory table per rank, the saved activations by op, the time split, the
// scaling projection; ends without the RESULT line (result_line).
std::string report(const Prediction& p, const MachineCosts& costs, const Link& link,
                   const std::vector<ScalingRow>& scale, int64_t save_every = 0,
                   bool compile = false);
std::string result_line(const Prediction& p);

// "64GiB", "512MiB", "1.5e9" -> bytes; "25GB/s" -> GB/s; "5us" -> microseconds.
int64_t parse_bytes(const std::string& text, const std::string& what);
double parse_gbs(const std::string& text, const std::string& what);
double parse_us(const std::string& text, const std::string& what);
int64_t machine_memory_bytes();  // MemTotal

}  // namespace kuai::plan
