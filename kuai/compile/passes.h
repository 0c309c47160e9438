// Graph passes over a captured step (technique 4), run before the memory plan. Each is switchable
// and keeps the step's numbers bit for bit (tested against the unfused graph and against eager):
//
//   dead_values     removes nodes whose outputs nothing reads (no named output, no later node)
//                   and that write none of their inputs;
//   add_layer_norm  a residual add whose sum feeds a LayerNorm becomes one AddLayerNorm node (the
//                   sum is still an output: the residual stream reads it again), so the rows are
//                   normalised while they are in cache instead of being read back from memory.
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

// After nodes were removed or replaced: every value's producer is its node's index again.
void renumber(Graph& graph);

}  // namespace kuai::compiler
