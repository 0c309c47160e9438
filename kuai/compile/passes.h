// Graph passes over a captured step (technique 4), run before the memory plan. Each is switchable
// and keeps the step's numbers bit for bit (tested against the unfused graph and against eager):
//
//   dead_values     removes nodes whose outputs nothing reads (no named output, no later node)
//                   and that write none of their inputs;
//   add_layer_norm  a residual add whose sum feeds a LayerNorm becomes one AddLayerNorm node (the
//                   sum is still an output: the residual stream reads it again), so the rows are
//                   normalised while they are in cache instead of being read back from memory.
//   layer_norm_backward_add
//                   a LayerNorm backward whose dx is only added into the residual gradient (add_)
//                   becomes one node that adds each block of dx into it while the block is in
//                   cache (LayerNormBackwardAdd): dx never goes through memory;
//   gelu_backward_sum
//                   GELU's backward and the bias gradient of the linear before it (a sum of its
//                   dx over every row) in one pass (GeluBackwardSum): each block of dx is summed
//                   as it is made, instead of being read back from memory;
//   cross_entropy   the loss's forward and backward in one pass over each block of logit rows
//                   (CrossEntropyWithGrad), its gradient written over the logits when they die
//                   there; the nodes that make backward's seed move up before it.
//   elementwise     a chain of fp32 elementwise nodes of one shape (add, sub, mul, div, scale,
//                   gelu, gelu_backward), each result read only by the next, becomes one node
//                   that runs the chain a block of 4096 elements at a time (FusedElementwise):
//                   the intermediates stay in a thread's cache. (The GPT's own graph has no such
//                   chain left after the passes above; models built from elementwise ops do.)
//   recompute       the normalised rows of every LayerNorm of a forward (each micro-batch's) are
//                   made again by a LayerNorm just before its backward's first read of them (the
//                   weight-gradient GEMM of the linear they fed), from the input and parameters the
//                   backward holds anyway, so they are not kept across the step's peak: the same
//                   bits (one kernel, the same inputs) for one more LayerNorm pass each.
//
// A pass rewrites Graph::nodes; values keep their ids (a removed node's outputs are left unread, as
// empty externals), and producers are renumbered.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kuai/compile/graph.h"
#include "kuai/compile/pass_options.h"

namespace kuai::compiler {

struct PassReport {
  std::vector<std::pair<std::string, int64_t>> rewrites;  // pass -> nodes it rewrote or removed
  int64_t nodes_before = 0, nodes_after = 0;
  int64_t get(const std::string& pass) const;
};

PassReport run_passes(Graph& graph, const PassOptions& options = {});

int64_t eliminate_dead_values(Graph& graph);
int64_t fuse_add_layer_norm(Graph& graph);
int64_t fuse_layer_norm_backward_add(Graph& graph);
int64_t fuse_gelu_backward_sum(Graph& graph);
int64_t fuse_cross_entropy(Graph& graph);
int64_t fuse_elementwise_chains(Graph& graph);
int64_t recompute_layer_norms(Graph& graph);

// After nodes were removed or replaced: every value's producer is its node's index again.
void renumber(Graph& graph);

}  // namespace kuai::compiler
