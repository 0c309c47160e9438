// The graph passes (see passes.h).
#include "kuai/compile/passes.h"

#include <fmt/format.h>

#include <memory>
#include <stdexcept>

#include "kuai/core/primitives.h"

namespace kuai::compiler {

int64_t PassReport::get(const std::string& pass) const {
  for (const auto& [name, n] : rewrites)
    if (name == pass) return n;
  return 0;
}

void renumber(Graph& graph) {
  for (Value& v : graph.values)
    if (v.producer >= 0) v.producer = -2;  // made by a removed node: left unread
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    for (int id : graph.nodes[i].outputs)
      graph.values[static_cast<size_t>(id)].producer = static_cast<int>(i);
  for (Value& v : graph.values)
    if (v.producer == -2) {  // never made now and never read: an empty external
      v.producer = -1;
      v.view = false;
      v.external = Tensor();
    }
}

int64_t eliminate_dead_values(Graph& graph) {
  std::vector<bool> read(graph.values.size(), false);
  for (const auto& [name, id] : graph.outputs) read[static_cast<size_t>(id)] = true;
  std::vector<bool> keep(graph.nodes.size(), false);
  for (size_t i = graph.nodes.size(); i-- > 0;) {
    const Node& node = graph.nodes[i];
    bool live = false;
    for (size_t k = 0; k < node.inputs.size(); ++k) live = live || node.primitive->mutates_input(k);
    for (int id : node.outputs) live = live || read[static_cast<size_t>(id)];
    if (!live) continue;
    keep[i] = true;
    for (int id : node.inputs) read[static_cast<size_t>(id)] = true;
  }
  std::vector<Node> kept;
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    if (keep[i]) kept.push_back(std::move(graph.nodes[i]));
  const auto removed = static_cast<int64_t>(graph.nodes.size() - kept.size());
  graph.nodes = std::move(kept);
  renumber(graph);
  return removed;
}

int64_t fuse_add_layer_norm(Graph& graph) {
  const size_t n = graph.nodes.size();
  // Per value: the nodes reading it; per node: whether it writes an input.
  std::vector<std::vector<int>> readers(graph.values.size());
  for (size_t i = 0; i < n; ++i)
    for (int id : graph.nodes[i].inputs) readers[static_cast<size_t>(id)].push_back(int(i));
  std::vector<bool> remove(n, false);
  int64_t fused = 0;
  for (size_t l = 0; l < n; ++l) {
    Node& ln = graph.nodes[l];
    const auto* norm = dynamic_cast<const LayerNorm*>(ln.primitive.get());
    if (norm == nullptr) continue;
    const int sum = ln.inputs[0];
    const Value& s = graph.values[static_cast<size_t>(sum)];
    if (s.producer < 0 || s.view || s.dtype != DType::kF32) continue;
    const auto a = static_cast<size_t>(s.producer);
    const Node& add = graph.nodes[a];
    const auto* bin = dynamic_cast<const Binary*>(add.primitive.get());
    if (bin == nullptr || bin->op() != BinaryOp::kAdd || add.outputs.size() != 1 || remove[a])
      continue;
    const Value &x = graph.values[static_cast<size_t>(add.inputs[0])],
                &y = graph.values[static_cast<size_t>(add.inputs[1])];
    if (x.shape != s.shape || y.shape != s.shape || x.dtype != DType::kF32 ||
        y.dtype != DType::kF32)
      continue;
    // The add moves down to the LayerNorm: nothing in between may read its sum or write what it
    // adds.
    bool clear = true;
    for (int r : readers[static_cast<size_t>(sum)]) clear = clear && r >= static_cast<int>(l);
    for (size_t i = a + 1; i < l && clear; ++i) {
      const Node& mid = graph.nodes[i];
      for (size_t k = 0; k < mid.inputs.size(); ++k)
        if (mid.primitive->mutates_input(k) &&
            (mid.inputs[k] == add.inputs[0] || mid.inputs[k] == add.inputs[1]))
          clear = false;
    }
    if (!clear) continue;
    Node f;
    f.primitive = std::make_shared<AddLayerNorm>(norm->eps());
    f.inputs = {add.inputs[0], add.inputs[1], ln.inputs[1], ln.inputs[2]};
    f.outputs = {sum};
    f.outputs.insert(f.outputs.end(), ln.outputs.begin(), ln.outputs.end());
    f.backward = ln.backward;
    f.scratch_bytes = std::max(add.scratch_bytes, ln.scratch_bytes);
    ln = std::move(f);
    remove[a] = true;
    ++fused;
  }
  std::vector<Node> kept;
  for (size_t i = 0; i < n; ++i)
    if (!remove[i]) kept.push_back(std::move(graph.nodes[i]));
  graph.nodes = std::move(kept);
  renumber(graph);
  return fused;
}

PassReport run_passes(Graph& graph, const PassOptions& options) {
  PassReport r;
  r.nodes_before = static_cast<int64_t>(graph.nodes.size());
  if (options.dead_values) r.rewrites.emplace_back("dead_values", eliminate_dead_values(graph));
  if (options.add_layer_norm) r.rewrites.emplace_back("add_layer_norm", fuse_add_layer_norm(graph));
  r.nodes_after = static_cast<int64_t>(graph.nodes.size());
  return r;
}

}  // namespace kuai::compiler
