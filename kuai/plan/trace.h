// A training step run on meta tensors (core/backend.h) and recorded: the planner's picture of a
// step, taken from the engine itself rather than described beside it. The step's parts are built
// as `kuai train` builds them (train/step_parts.h), or by the caller for any model made of kuai's
// modules and ops, on the meta device and a recording process group of the run's ranks; then
// TrainStep runs two steps (the first creates the optimizer state) through the real autograd
// engine, autocast, accumulation, DDP's buckets and ZeRO's shards. No byte is computed.
//
// What is recorded:
//   - memory: every block the caching allocator hands out on meta, by what the engine says it is
//     for (core/allocator.h MemoryUse), with the kernels' scratch by their own formulas
//     (Primitive::cpu_scratch, taken by the meta backend) plus what the caller adds for the
//     products (whose scratch depends on the implementation the GEMM router picks); the peak of
//     live tensors, what was live at it and where the step was; what stays between steps; the
//     tensors autograd saved for backward at the end of the last micro-batch's forward;
//   - time: the last step's ops on the training thread in dispatch order, each with its
//     primitive, its inputs' layouts, its cost and whether backward was running, and the
//     collectives it launched, each placed between two ops. plan/costs.h times the distinct ops
//     on this machine; plan.h replays the list against those times and the link.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/core/primitive.h"
#include "kuai/distributed/process_group.h"
#include "kuai/train/config.h"
#include "kuai/train/step_parts.h"

namespace kuai::plan {

using UseBytes = std::array<int64_t, static_cast<size_t>(MemoryUse::kCount)>;

// An input as its kernel saw it: enough to lay out a CPU tensor alike.
struct Layout {
  Shape shape;
  Shape strides;
  int64_t offset = 0;
  int64_t storage_elements = 0;
  DType dtype = DType::kF32;
  bool weight = false;  // a parameter or its autocast copy: does not grow with the batch
};

struct OpRecord {
  std::shared_ptr<const Primitive> primitive;
  std::vector<Layout> in;
  std::vector<TensorSpec> out;
  Cost cost;
  int64_t formula_scratch = 0;  // what Primitive::cpu_scratch states, all blocks together
  bool backward = false;        // dispatched while backward was running
  bool view = false;
  std::string key;  // ops with the same key cost the same (primitive, layouts, outputs)
};

struct CollectiveEvent {
  dist::CollectiveRecord collective;
  size_t at = 0;  // ops of the step dispatched before it was launched
  // An all_gather (ZeRO-3's units, ZeRO-1/2's updated shards): the index of the first op that
  // reads what it fills, where the step waits for it; none (kNever): waited for as it launches.
  static constexpr size_t kNever = static_cast<size_t>(-1);
  size_t needed_at = kNever;
};

// A row of the table of tensors saved for backward: one primitive's saved input or output.
struct SavedRow {
  std::string what;  // "attention output 1 (bfloat16)"
  int64_t count = 0;
  int64_t bytes = 0;  // allocator blocks
};

struct StepTrace {
  int64_t peak_bytes = 0;  // the meta allocator's peak over the traced steps
  UseBytes at_peak{};      // what was live at that peak
  std::string peak_where;  // "backward (linear_backward), micro-batch 2 of 2, step 2"
  UseBytes persistent{};   // live after the last step: held across steps
  int64_t saved_total = 0;
  std::vector<SavedRow> saved;  // at the end of the last micro-batch's forward, largest first
  int64_t workspace_max = 0;    // the largest single scratch block
  std::vector<OpRecord> ops;    // the last step's, training thread, dispatch order
  std::vector<CollectiveEvent> collectives;  // the last step's, launch order
  int64_t tokens = 0;                        // per step and rank
  bool compiled = false;  // the memory is the compiled step's (TraceTarget::build_compiled)
};

struct TraceTarget {
  // Builds the parts on the default device (meta while traced) over `group`.
  std::function<std::unique_ptr<train::StepParts>(std::shared_ptr<dist::ProcessGroup>)> build;
  int64_t batch = 1, seq = 1;  // (B, T) int32 inputs and targets per micro-batch
  int64_t accum = 1;           // micro-batches per step (the parts' StepOptions must agree)
  int64_t loader_slots = 1;    // batches the loader holds besides the one in use
  int world = 1;               // ranks (rank 0 is traced)
  // Scratch an op takes beyond its formula (the products': measured by plan/costs.h).
  std::function<int64_t(const OpRecord&)> extra_scratch;
  // train.compile: the same parts with a compiled step. Set, the trace's memory (peak, what was
  // live at it, what stays between steps) is the compiled step's, traced as it runs: captured on
  // meta, then replayed in its planned arena; its ops and their times stay the eager step's
  // (before the graph's fusions).
  std::function<std::unique_ptr<train::StepParts>(std::shared_ptr<dist::ProcessGroup>)>
      build_compiled;
};

StepTrace trace_step(const TraceTarget& target);

// `kuai train`'s step for `cfg` on `ranks` ranks (train.compile: the memory of the compiled step,
// the time of the eager one).
TraceTarget target_for(const train::TrainConfig& cfg, int64_t ranks);

}  // namespace kuai::plan
