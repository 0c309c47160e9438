// `kuai bench compile` (technique 4): eager and compiled training steps of the same model on the
// same batches, interleaved step by step in one process (each step, every arm once, the order
// reversed on odd steps), so the machine's drift lands on all arms alike. Arms: eager, compiled
// with every pass, and compiled with each pass off in turn. The step is the trainer's
// single-process step (autocast over the micro-batches, the fp16 loss scale on the device,
// unscale and overflow check, global-norm clipping, AdamW, zero_grad) with the lr schedule
// written into the optimizer's device tensor before each step. Every arm's loss is compared with
// eager's at every step: a compiled step must give the same bits. Medians of the kept steps, with
// the quartiles as the spread, per-arm graph size and arena bytes.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "kuai/train/config.h"

namespace kuai::train {

struct CompileBenchArm {
  std::string label;
  std::string disabled;  // the passes switched off (compiled arms)
  bool compiled = false;
  std::vector<double> step_ms;  // kept steps
  double median_ms = 0, p25_ms = 0, p75_ms = 0;
  int64_t nodes = 0;  // of the replayed graph
  int64_t arena_bytes = 0;
  double speedup = 0;  // eager median / this median
};

struct CompileBench {
  std::string precision;
  std::string model;  // "GPT 4 layers, d_model 256, T 256, batch 16"
  int64_t steps = 0, warmup = 0;
  std::vector<CompileBenchArm> arms;  // arms[0] is eager
  bool losses_equal = true;           // every arm's loss == eager's at every step
  int64_t eager_peak_bytes = 0;       // allocator peak of a steady eager step, above what lives
  int64_t compiled_peak_bytes = 0;    // the same for a replay (arena included)
};

CompileBench run_compile_bench(const TrainConfig& cfg, int64_t steps, int64_t warmup,
                               std::ostream& progress);
std::string compile_bench_markdown(const std::vector<CompileBench>& runs);

}  // namespace kuai::train
