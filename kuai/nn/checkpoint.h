// Activation recomputation ("activation checkpointing"), the non-reentrant kind PyTorch
// recommends: checkpoint(fn, inputs) runs fn as usual, recording the ordinary autograd graph, but
// the tensors its nodes save for backward pass through saved-tensor hooks (core/autograd.h).
// When fn returns, every saved tensor that fn made and that nothing outside the backward still
// holds is dropped, unless the policy keeps it; the first node of the region's backward that needs
// a dropped tensor replays, once, the ops of fn that make the dropped tensors, from the region's
// inputs and the tensors that were kept. A replay runs the same primitives on the same inputs, so
// it makes the same bits: losses, gradients and weights equal a run without recomputation.
//
// Being an ordinary graph, a region needs nothing from the code around it: autocast (the casts
// are ops of the region, replayed as they ran), gradient accumulation, DDP's grad-ready hooks and
// their overlap (the same nodes run in the same order), ZeRO, and compile's capture (the replay's
// ops are dispatched in backward, where capture records them) all work unchanged. Saved-tensor
// hooks around a region (ZeRO-3's, which keep a parameter's view without its bytes) pack what the
// region did not make, both the tensors its nodes save and the inputs its replay will read, so a
// replayed block's forward gathers its unit again as its nodes would.
//
// Policies (Megatron-LM's names):
//   kFull       keep only the region's inputs (and what outlives the region anyway: its outputs,
//               the parameters, autocast's cached weight casts); the replay reruns the region's
//               forward up to the last op whose output a node saved.
//   kSelective  keep, besides, the outputs of the ops Primitive::kept_by_selective_recompute
//               names (the products' outputs, attention's output and log-sum-exp); drop and
//               replay the cheap, memory-heavy rest (norms, GELU / SwiGLU, RoPE, casts, copies,
//               residual sums, a materialised attention's probabilities).
//   kNone       no recomputation: checkpoint() only calls fn.
// Outside grad mode, or inside another region (they do not nest: the inner one is part of the
// outer), checkpoint() only calls fn. Ops that write their inputs or talk to other processes are
// refused inside a region (a replay would do it twice).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::nn {

enum class Recompute { kNone, kSelective, kFull };
const char* recompute_name(Recompute r);  // "none" | "selective" | "full"
// Throws std::invalid_argument naming the allowed values.
Recompute parse_recompute(const std::string& name);

using CheckpointFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

std::vector<Tensor> checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs,
                               Recompute policy = Recompute::kFull);
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                  Recompute policy = Recompute::kFull);

// What recomputation did in this process since the last reset (tests, benchmarks).
struct RecomputeStats {
  int64_t regions = 0;        // regions that recorded something
  int64_t dropped_bytes = 0;  // saved tensors' bytes dropped at the regions' exits
  int64_t kept_bytes = 0;     // saved tensors made in a region and kept (policy or held)
  int64_t replays = 0;        // regions replayed in backward
  int64_t replayed_ops = 0;   // ops those replays ran
};
RecomputeStats recompute_stats();
void reset_recompute_stats();

}  // namespace kuai::nn
