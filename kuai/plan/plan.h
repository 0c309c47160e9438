// `kuai plan`: what a training run will need and how fast it will go, predicted before it starts
// by running its step on meta tensors (plan/trace.h: the real model, autograd, autocast,
// accumulation, DDP and ZeRO, with no byte computed) and pricing what it recorded at this
// machine's measured costs (plan/costs.h: every distinct op run here) plus the link's latency
// and bandwidth (measured by `kuai bench ddp`, or given).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kuai/plan/costs.h"
#include "kuai/plan/trace.h"
#include "kuai/train/config.h"

namespace kuai::plan {

// The run a plan describes (for its report and its time model).
struct StepSpec {
  nn::GPTConfig model;  // resolved
  int64_t batch = 16;   // rows per micro-batch per rank
  int64_t seq = 256;    // T
  int64_t accum = 1;    // micro-batches per step
  DType compute = DType::kF32;
  bool flash = false;  // attention implementation in force
  int64_t ranks = 1;
  int64_t zero = 0;  // 0, 1, 2
  std::string compression = "none";
  int64_t threads = 1;
  std::string recompute = "none";  // train.recompute
  int64_t recompute_layers = 0;    // blocks recomputed (0 with "none")
  std::string offload = "none";    // train.offload
  bool offload_master = false;     // train.offload_master
};
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
// The measured link, else an assumption (10 GB/s, 20 us) whose source says so and how to measure
// it.
Link measured_or_assumed_link();
void save_link(const Link& link);

struct TimePrediction {
  double products_s = 0;      // ops with FLOPs (the products), attention's excepted
  double attention_s = 0;     // attention's kernels
  double memory_s = 0;        // every other kernel (memory-bound passes, the optimizer)
  double disk_s = 0;          // the offloaded update, streaming its files (at the disk's rate)
  double overhead_s = 0;      // dispatching the step's ops
  double comm_s = 0;          // the collectives, end to end
  double comm_exposed_s = 0;  // what the step waits for them (what overlap does not hide)
  double step_s = 0;
  double tokens_per_s = 0;  // over all ranks
  double flops = 0;         // per rank and step
};

struct Prediction {
  StepSpec spec;
  StepTrace step;
  TimePrediction time;
  int64_t budget_bytes = 0;
  bool fits() const { return step.peak_bytes <= budget_bytes; }
};

// Predicts `cfg` on `ranks` ranks; `costs` is filled with what it measures (ops already there are
// not measured again).
Prediction predict(const train::TrainConfig& cfg, int64_t ranks, int64_t budget_bytes,
                   const Link& link, MachineCosts& costs);
// The same for any step: `target` built as the caller says (a model kuai train does not build).
Prediction predict_target(const TraceTarget& target, const StepSpec& spec, int64_t budget_bytes,
                          const Link& link, MachineCosts& costs);
// Replays the trace's ops in order at their measured times plus the dispatch cost of each, with
// the collectives on one communication thread in launch order: one launched during backward
// runs while the step goes on and is waited for when backward ends; an all_gather is waited for
// by the first op that reads what it fills (ZeRO-3's units prefetched while the units before them
// compute, forward and backward; ZeRO-1/2's updated shards at once, by the copy into the
// parameters); another one launched outside backward (DDP without overlap) is waited for at once;
// scalars (the loss, the stop flag) are never waited for within the step.
TimePrediction predict_time(const StepSpec& spec, const StepTrace& step, const MachineCosts& costs,
                            const Link& link);

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
