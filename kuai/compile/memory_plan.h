// The memory plan of a captured step (technique 4): every intermediate value of the graph gets a
// byte range in one arena that is allocated once, so a replay allocates nothing for them. What
// stays outside: the externals (parameters, optimizer state, the batch, constants), views (they
// alias their base) and the named outputs (they outlive the run: the metric ring holds a loss for
// steps).
//
// Liveness: a value lives from the node that makes it to the last node that reads it or any view
// of it (transitively), writers included. An output may take over the buffer of an input that
// dies at its node (Primitive::reusable_input: an elementwise op, a backward reusing its
// activation), so the two share one buffer. Buffers are then placed largest first, each in the
// smallest gap left by the placed buffers whose lifetimes overlap its own (best fit), or at the
// top; every offset is 64-byte aligned. A node whose kernels took scratch at capture gets a buffer
// of that size alive at the node alone, lent to them at replay (kuai/core/allocator.h).
// `lower_bound` is the most bytes live at any one node, what no placement can beat.
#pragma once

#include <cstdint>
#include <vector>

#include "kuai/compile/graph.h"

namespace kuai::compiler {

struct MemoryPlan {
  static constexpr int64_t kAlignment = 64;
  std::vector<int64_t> offset;  // per value: byte offset in the arena; -1: not planned
  std::vector<int> buffer_of;   // per value: its buffer (-1: not planned)
  struct Buffer {
    int64_t bytes = 0, offset = 0;
    int first = 0, last = 0;  // nodes: made at `first`, dead after `last`
  };
  std::vector<Buffer> buffers;
  std::vector<int> scratch_of;  // per node: the buffer lent to its kernels' scratch (-1: none)
  // Per node: the buffers whose last use it is (their bytes are free after it).
  std::vector<std::vector<int>> dies_after;
  int64_t arena_bytes = 0;
  int64_t lower_bound = 0;     // max over nodes of the bytes of the buffers live there
  int64_t planned_bytes = 0;   // sum over buffers (what allocating each separately would hold)
  int64_t inplace_reuses = 0;  // outputs written over a dying input's buffer
};

// Per value, the index of the last node that reads it (-1: none); the named outputs count as read
// after the last node (graph.nodes.size()).
std::vector<int> last_uses(const Graph& graph);

// `in_place`: let outputs take over dying inputs' buffers (off: each value its own buffer).
MemoryPlan plan_memory(const Graph& graph, bool in_place = true);

}  // namespace kuai::compiler
