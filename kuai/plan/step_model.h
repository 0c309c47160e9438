// A training step of a GPT-2 or LLaMA model described from its shapes alone, without running it:
// every tensor the step allocates (parameters, optimizer state, autocast's weight casts, each
// op's outputs and what it saves for backward, the gradients, DDP's buckets and ZeRO's shards,
// kernels' scratch) replayed through a model of kuai's caching allocator, in the order the eager
// trainer allocates and frees them, and every product and memory-bound pass the step runs.
//
// The replay mirrors the engine rather than a textbook formula: each forward op records a node
// that keeps exactly the tensors its primitive saves (Primitive::saves_input / saves_output), the
// backward walks the nodes in the autograd engine's order (the highest sequence number among the
// ready nodes first, so the weight casts of a later micro-batch run last), frees each node's saved
// tensors after its vjp and each gradient when its last holder lets go, and the allocator model
// rounds each request (64 B under 1 MiB, 64 KiB above) and reuses cached blocks up to 1.25x the
// request, as kuai/core/allocator.cpp does. What the replay says at its peak is what `kuai train`
// measures (tests/plan/test_plan.cpp holds it to that on several configurations).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kuai/core/dtype.h"
#include "kuai/nn/gpt.h"

namespace kuai::plan {

// What a live byte is for (one row each in the plan's memory table).
enum class Kind : int {
  kParameters,   // fp32 parameters (the master weights)
  kGradients,    // parameter gradients (DDP: its buckets; ZeRO-2: the shard)
  kOptimizer,    // AdamW's moments (ZeRO: this rank's shard)
  kWeightCasts,  // autocast's low-precision copies of the weights, kept for one step
  kActivations,  // op outputs alive in forward and saved for backward
  kActGrads,     // gradients of activations in flight during backward
  kComm,         // compression wire buffers, error feedback, ZeRO's all-gather buffers
  kWorkspace,    // kernels' scratch
  kData,         // the loader's batch slots, small state
  kCount
};
const char* kind_name(Kind k);
using KindBytes = std::array<int64_t, static_cast<size_t>(Kind::kCount)>;

// One parameter tensor, in the model's registration order (Module::named_parameters).
struct ParamShape {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel() const;
};
std::vector<ParamShape> parameter_shapes(const nn::GPTConfig& cfg);

// One product of the step: C(m, n) = op(A) op(B), k deep, `batch` of them; `count` per step.
struct Product {
  std::string what;  // "h.*.mlp.c_fc forward", ...
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, batch = 1;
  DType a = DType::kF32, b = DType::kF32, c = DType::kF32;
  bool bias = false;
  int64_t count = 1;
  double flops() const { return 2.0 * double(m) * double(n) * double(k) * double(batch); }
};

// A memory-bound pass (an elementwise op, a norm, a loss, a cast, the optimizer): the bytes it
// reads and writes and, for a kernel the planner can run (plan/costs.h), which one at what shape.
struct Pass {
  std::string what;
  double bytes = 0;
  int64_t count = 1;
  std::string kernel;          // "layer_norm", "rms_norm", "gelu", "swiglu", "rope", "add",
                               // "cast", "sum_rows", "embedding", "cross_entropy"; "": bytes only
  std::vector<int64_t> shape;  // the kernel's input shape (embedding: V, C, rows)
  DType dtype = DType::kF32;   // its input dtype (cast: the target; add: the second operand's)
  DType from = DType::kF32;    // cast: the source; add: the first operand's
  bool backward = false;       // the kernel's backward (measured as forward + backward - forward)
  bool per_step = false;       // once per optimizer step, not per micro-batch
  double theta = 10000.0;      // rope
  int64_t rotated = -1;        // rope: heads rotated
};

// Attention's own kernels (not routed products): FLOPs and the shape they run at.
struct AttentionWork {
  bool flash = false;
  int64_t B = 0, H = 0, Hkv = 0, T = 0, d = 0;
  DType dtype = DType::kF32;
  int64_t count = 0;     // calls per step (layers x micro-batches), forward and backward each
  double flops_fwd = 0;  // per call, causal
  double flops_bwd = 0;
};

// What the step runs, as the planner sees it.
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
  bool error_feedback = false;
  double bucket_mb = 25.0, first_bucket_mb = 1.0;
  int64_t threads = 1;       // OpenMP threads of the kernels (scratch per thread)
  int64_t loader_slots = 4;  // workers x prefetch_factor (1 without workers)
  bool fp16_scaler = false;  // precision fp16: GradScaler's unscale pass
  // The scratch a product takes on this machine (the implementation the router picks decides
  // it; plan/costs.h measures it). Empty: none.
  std::function<int64_t(const Product&)> gemm_scratch;
};

// A row of the table of activations saved for backward.
struct SavedRow {
  std::string what;   // "h.*.mlp gelu input"
  int64_t count = 0;  // tensors of this kind alive at the end of forward
  int64_t bytes = 0;  // their total (allocator blocks)
};

struct StepModel {
  int64_t peak_bytes = 0;       // the allocator's peak of live tensors over two steps
  KindBytes at_peak{};          // what was live at that peak, by kind
  std::string peak_where;       // "backward of h.3.mlp.c_fc, micro-batch 1 of 2, step 2"
  KindBytes persistent{};       // held across steps (parameters, moments, buckets, ...)
  int64_t saved_total = 0;      // activations alive at the end of the last micro-batch's forward
  std::vector<SavedRow> saved;  // ... by op
  int64_t workspace_max = 0;    // the largest single scratch request
  std::vector<Product> products;
  std::vector<Pass> passes;
  std::vector<AttentionWork> attention;
  int64_t ops_per_step = 0;  // dispatched kernels (per-op overhead)
  // Communication per step and rank, as kuai's collectives send it.
  struct Collective {
    std::string what;             // "all_reduce bucket 3", "reduce_scatter", "all_gather"
    std::string op;               // "all_reduce" | "reduce_scatter" | "all_gather"
    double bytes = 0;             // the buffer the collective is called with (per rank)
    double ready_fraction = 1.0;  // share of backward done when it can start (overlap model)
  };
  std::vector<Collective> collectives;
  double grad_bytes_fp32 = 0;  // 4 x parameters (padded as the buckets are)
};

// Replays two steps of `spec` (the first creates the optimizer state) and returns the model.
StepModel model_step(const StepSpec& spec);

}  // namespace kuai::plan
