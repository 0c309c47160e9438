// The ablation harness behind `kuai bench <technique>` and `kuai bench --all`: for a technique it
// trains the same config with the technique off and on (the arms differ in the technique's keys
// alone), in ABBA order across rounds (off, on, ...; then ..., on, off) in one process, drops
// warm-up steps, and reports median step-time ratio, tokens/s, allocator peak, peak RSS and the
// technique's own figure, beside the gain the well-known advice claims. Each arm's spread is the
// min-max of its per-round medians; when the two arms' ranges overlap the row says "within
// noise" instead of a ratio. Output: a markdown table, a JSON file and an SVG chart (whiskers for
// the spread, the advice's claimed range beside each bar). Every technique adds its row here.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "kuai/train/config.h"

namespace kuai::train {

struct ArmStats {
  std::string label;
  std::vector<double> step_ms;   // kept steps of every round
  std::vector<double> round_ms;  // the median kept step of each round
  double step_ms_median = 0;
  double step_ms_min = 0, step_ms_max = 0;  // the spread: min and max of round_ms
  double tokens_per_s = 0;
  double peak_alloc_mib = 0;  // max over rounds of the allocator's peak of live tensors
  double peak_rss_mib = 0;    // max over rounds of the sampled resident set during the run
  double reserved_mib = 0;    // max over rounds of the allocator's reserved bytes at the end
  double figure = 0;          // the technique's own figure (data wait ms, host reads/step, ...)
  TrainConfig config;         // what this arm trained
};

struct AblationRow {
  std::string technique;
  std::string figure_name;  // what ArmStats::figure measures
  std::string claim;        // what the well-known advice says it buys
  ArmStats off, on;
  std::vector<ArmStats> extra;  // reference arms (prefetch: the instant loader)
  std::string verdict;          // the measured gain in words
  // The advice's claimed range, where it gives numbers (0 when it does not).
  double claim_speedup_lo = 0, claim_speedup_hi = 0;
  double claim_memory_lo = 0, claim_memory_hi = 0;
  double speedup() const;       // off / on median step time
  double speedup_lo() const;    // the spread of the ratio: off min / on max
  double speedup_hi() const;    // off max / on min
  bool within_noise() const;    // the arms' round ranges overlap
  double memory_ratio() const;  // on / off allocator peak
};

struct AblationOptions {
  int64_t steps = 12;  // per run
  int64_t warmup = 2;  // dropped from the front of each run
  int64_t rounds = 2;  // off/on pairs (ABBA: odd rounds run the arms in reverse)
};

const std::vector<std::string>& ablation_techniques();  // "accumulation", "prefetch", "metrics"

// `base` is the workload (model, batch, data); each technique sets only its own keys.
AblationRow run_ablation(const std::string& technique, const TrainConfig& base,
                         const AblationOptions& options, std::ostream& progress);

// Checkpoints (technique 9): size and save time of a weights-only export against a full,
// resumable checkpoint, and of a synchronous against an asynchronous full save (the part that
// blocks the training step). Medians over `rounds` alternating saves of the base model.
struct CheckpointBench {
  std::string model;                    // "GPT 4 layers, ... (3.29M parameters)"
  double export_mib = 0, full_mib = 0;  // on disk
  double export_ms = 0;                 // weights-only, fp32, synchronous
  double full_sync_ms = 0;              // full checkpoint, synchronous (blocked = total)
  double full_async_blocked_ms = 0;     // full checkpoint, asynchronous: the step's part
  double full_async_total_ms = 0;       // ... and the writer's
  int64_t rounds = 0;
  std::string claim = "weights-only checkpoints are about 3x smaller and 5x faster to save";
  double size_ratio() const { return export_mib > 0 ? full_mib / export_mib : 0; }
  double time_ratio() const { return export_ms > 0 ? full_sync_ms / export_ms : 0; }
  double async_share() const { return full_sync_ms > 0 ? full_async_blocked_ms / full_sync_ms : 0; }
};

CheckpointBench run_checkpoint_bench(const TrainConfig& base, int64_t rounds,
                                     const std::string& scratch_dir, std::ostream& progress);

std::string ablation_markdown(const std::vector<AblationRow>& rows);
std::string checkpoint_markdown(const CheckpointBench& c);
std::string ablation_json(const std::vector<AblationRow>& rows, const TrainConfig& base,
                          const AblationOptions& options,
                          const CheckpointBench* checkpoint = nullptr);
// `machine`: the CPU model and kernel tier, for the title ("Intel Xeon ..., tier avx512_bf16").
std::string ablation_svg(const std::vector<AblationRow>& rows, const std::string& machine = "");

}  // namespace kuai::train
