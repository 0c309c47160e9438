// The graph passes (see passes.h).
#include "kuai/compile/passes.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>

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

namespace {

// The value a view value aliases, following view nodes to the buffer that owns the memory.
int root_of(const Graph& g, int id) {
  while (true) {
    const Value& v = g.values[static_cast<size_t>(id)];
    if (!v.view || v.producer < 0) return id;
    id = g.nodes[static_cast<size_t>(v.producer)].inputs[0];
  }
}

// Whether a node of (first, last) other than those in `skip` reads (when `reads`) or writes the
// memory of `root`: moving an access to `root` across such a node would change what it sees.
bool touched_between(const Graph& g, size_t first, size_t last, int root, bool reads,
                     const std::vector<bool>* skip = nullptr) {
  for (size_t i = first + 1; i < last; ++i) {
    if (skip && (*skip)[i]) continue;
    const Node& n = g.nodes[i];
    for (size_t k = 0; k < n.inputs.size(); ++k)
      if (root_of(g, n.inputs[k]) == root && (reads || n.primitive->mutates_input(k))) return true;
  }
  return false;
}

// Per root value: the nodes that read it or a view of it (view nodes themselves excepted).
std::vector<std::vector<int>> readers_by_root(const Graph& g) {
  std::vector<std::vector<int>> r(g.values.size());
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].primitive->is_view()) continue;
    for (int id : g.nodes[i].inputs) r[static_cast<size_t>(root_of(g, id))].push_back(int(i));
  }
  return r;
}

// The node that replaces `at` (taking its place and its forward / backward side) and `other`;
// its kernel scratch is the larger of theirs.
Node fused_node(std::shared_ptr<const Primitive> p, std::vector<int> inputs,
                std::vector<int> outputs, const Node& at, const Node& other) {
  Node f;
  f.primitive = std::move(p);
  f.inputs = std::move(inputs);
  f.outputs = std::move(outputs);
  f.backward = at.backward;
  f.scratch_bytes = std::max(at.scratch_bytes, other.scratch_bytes);
  return f;
}

// Removes the marked nodes and renumbers the producers.
void drop(Graph& graph, const std::vector<bool>& remove) {
  std::vector<Node> kept;
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    if (!remove[i]) kept.push_back(std::move(graph.nodes[i]));
  graph.nodes = std::move(kept);
  renumber(graph);
}

}  // namespace

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
    // a fp32; b fp32 or a low-precision branch (fp32 + bf16 is the residual add under autocast;
    // the sum is commutative, so the fp32 operand goes first).
    int ia = add.inputs[0], ib = add.inputs[1];
    if (graph.values[static_cast<size_t>(ia)].dtype != DType::kF32) std::swap(ia, ib);
    const Value &x = graph.values[static_cast<size_t>(ia)],
                &y = graph.values[static_cast<size_t>(ib)];
    if (x.shape != s.shape || y.shape != s.shape || x.dtype != DType::kF32 ||
        !(y.dtype == DType::kF32 || y.dtype == DType::kBF16 || y.dtype == DType::kF16))
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
    std::vector<int> out = {sum};
    out.insert(out.end(), ln.outputs.begin(), ln.outputs.end());
    ln = fused_node(std::make_shared<AddLayerNorm>(norm->eps()),
                    {ia, ib, ln.inputs[1], ln.inputs[2]}, std::move(out), ln, add);
    remove[a] = true;
    ++fused;
  }
  drop(graph, remove);
  return fused;
}

int64_t fuse_layer_norm_backward_add(Graph& graph) {
  const std::vector<std::vector<int>> readers = readers_by_root(graph);
  std::vector<bool> remove(graph.nodes.size(), false);
  int64_t fused = 0;
  for (size_t a = 0; a < graph.nodes.size(); ++a) {
    const Node& add = graph.nodes[a];
    if (dynamic_cast<const AddInPlace*>(add.primitive.get()) == nullptr) continue;
    const int r = add.inputs[0], d = add.inputs[1];
    const Value &rv = graph.values[static_cast<size_t>(r)],
                &dv = graph.values[static_cast<size_t>(d)];
    if (dv.view || dv.producer < 0 || rv.view || rv.dtype != DType::kF32 || dv.dtype != DType::kF32)
      continue;
    const auto l = static_cast<size_t>(dv.producer);
    Node& lnb = graph.nodes[l];
    if (dynamic_cast<const LayerNormBackward*>(lnb.primitive.get()) == nullptr ||
        lnb.outputs[0] != d || remove[l])
      continue;
    // dx is read by the add alone; the accumulator exists before the LayerNorm backward and
    // nothing between the two reads or writes it (its update moves up to the backward).
    if (readers[static_cast<size_t>(d)] != std::vector<int>{static_cast<int>(a)}) continue;
    if (rv.producer >= static_cast<int>(l) || touched_between(graph, l, a, root_of(graph, r), true))
      continue;
    std::vector<int> in = lnb.inputs;
    in.push_back(r);
    lnb = fused_node(std::make_shared<LayerNormBackwardAdd>(), std::move(in),
                     {lnb.outputs[1], lnb.outputs[2]}, lnb, add);
    remove[a] = true;
    ++fused;
  }
  drop(graph, remove);
  return fused;
}

int64_t fuse_gelu_backward_sum(Graph& graph) {
  std::vector<bool> remove(graph.nodes.size(), false);
  int64_t fused = 0;
  for (size_t s = 0; s < graph.nodes.size(); ++s) {
    const Node& sum = graph.nodes[s];
    const auto* red = dynamic_cast<const Sum*>(sum.primitive.get());
    if (red == nullptr) continue;
    // The summed value is dx itself or a reshape of it (view nodes only, no permutation).
    int id = sum.inputs[0];
    bool reshapes = true;
    while (graph.values[static_cast<size_t>(id)].view && reshapes) {
      const Node& v =
          graph.nodes[static_cast<size_t>(graph.values[static_cast<size_t>(id)].producer)];
      reshapes = dynamic_cast<const View*>(v.primitive.get()) != nullptr;
      id = v.inputs[0];
    }
    const Value& dx = graph.values[static_cast<size_t>(id)];
    if (!reshapes || dx.producer < 0 || dx.dtype != DType::kF32) continue;
    const auto g = static_cast<size_t>(dx.producer);
    Node& gb = graph.nodes[g];
    if (dynamic_cast<const GeluBackward*>(gb.primitive.get()) == nullptr || gb.outputs[0] != id ||
        remove[g])
      continue;
    bool f32 = true;
    for (int in : gb.inputs)
      f32 = f32 && graph.values[static_cast<size_t>(in)].dtype == DType::kF32;
    // A sum over every row: the axes before the summed one are all 1, the ones after it are the
    // last axis of dx.
    const Shape& shape = graph.values[static_cast<size_t>(sum.inputs[0])].shape;
    int64_t outer = 1, inner = 1;
    for (int64_t i = 0; i < red->dim(); ++i) outer *= shape[static_cast<size_t>(i)];
    for (size_t i = static_cast<size_t>(red->dim()) + 1; i < shape.size(); ++i) inner *= shape[i];
    if (!f32 || dx.shape.empty() || outer != 1 || inner != dx.shape.back()) continue;
    // The sum moves up to the backward: nothing in between may write dx.
    if (touched_between(graph, g, s, id, false)) continue;
    const int db = sum.outputs[0];
    gb = fused_node(std::make_shared<GeluBackwardSum>(graph.values[static_cast<size_t>(db)].shape),
                    gb.inputs, {id, db}, gb, sum);
    remove[s] = true;
    ++fused;
  }
  drop(graph, remove);
  return fused;
}

int64_t fuse_cross_entropy(Graph& graph) {
  int64_t fused = 0;
  for (size_t b = 0; b < graph.nodes.size(); ++b) {
    const auto* ceb = dynamic_cast<const CrossEntropyBackward*>(graph.nodes[b].primitive.get());
    if (ceb == nullptr) continue;
    const std::vector<int> bin = graph.nodes[b].inputs;  // logits, targets, lse, count, dloss
    const Value& lse = graph.values[static_cast<size_t>(bin[2])];
    if (lse.producer < 0) continue;
    const auto f = static_cast<size_t>(lse.producer);
    const Node& fwd = graph.nodes[f];
    const auto* ce = dynamic_cast<const CrossEntropy*>(fwd.primitive.get());
    if (ce == nullptr || ce->ignore_index() != ceb->ignore_index() || fwd.outputs[1] != bin[2] ||
        fwd.outputs[2] != bin[3] || fwd.inputs[0] != bin[0] || fwd.inputs[1] != bin[1])
      continue;
    const Value& seed = graph.values[static_cast<size_t>(bin[4])];
    if (seed.dtype != DType::kF32 || seed.shape.size() > 1 ||
        (seed.shape.size() == 1 && seed.shape[0] != 1))
      continue;
    // The nodes between the two that make dloss (backward's seed, scaled) move up before the
    // forward: they may not read what the forward made or what a node in between writes.
    std::vector<bool> move(graph.nodes.size(), false), after_f(graph.values.size(), false);
    for (int id : fwd.outputs) after_f[static_cast<size_t>(id)] = true;
    std::vector<int> todo = {bin[4]};
    bool ok = true;
    while (!todo.empty() && ok) {
      const int id = todo.back();
      todo.pop_back();
      const Value& v = graph.values[static_cast<size_t>(id)];
      if (after_f[static_cast<size_t>(id)] || v.producer >= static_cast<int>(b)) ok = false;
      if (!ok || v.producer < static_cast<int>(f)) continue;  // external or made before
      const auto p = static_cast<size_t>(v.producer);
      if (move[p]) continue;
      move[p] = true;
      const Node& n = graph.nodes[p];
      for (size_t k = 0; k < n.inputs.size(); ++k) {
        ok = ok && !n.primitive->mutates_input(k);
        todo.push_back(n.inputs[k]);
      }
    }
    if (!ok) continue;
    for (size_t i = f + 1; i < b && ok; ++i)
      if (move[i])
        for (int id : graph.nodes[i].inputs)
          ok = ok && !touched_between(graph, f, i, root_of(graph, id), false, &move);
    const int logits = root_of(graph, bin[0]), targets = root_of(graph, bin[1]);
    if (!ok || touched_between(graph, f, b, logits, false) ||
        touched_between(graph, f, b, targets, false))
      continue;
    std::vector<int> out = fwd.outputs;
    out.insert(out.end(), graph.nodes[b].outputs.begin(), graph.nodes[b].outputs.end());
    Node fusedn = fused_node(std::make_shared<CrossEntropyWithGrad>(ce->ignore_index()),
                             {bin[0], bin[1], bin[4]}, std::move(out), fwd, graph.nodes[b]);
    std::vector<Node> order;
    for (size_t i = 0; i < f; ++i) order.push_back(std::move(graph.nodes[i]));
    for (size_t i = f + 1; i < b; ++i)
      if (move[i]) order.push_back(std::move(graph.nodes[i]));
    order.push_back(std::move(fusedn));
    for (size_t i = f + 1; i < graph.nodes.size(); ++i)
      if (!move[i] && i != b) order.push_back(std::move(graph.nodes[i]));
    graph.nodes = std::move(order);
    renumber(graph);
    ++fused;
    b = f;  // the fused node's position; the scan continues after it
  }
  return fused;
}

namespace {

// An fp32 elementwise node the chain fuser can take: one output, every operand of its shape.
bool chainable(const Graph& g, const Node& n) {
  const Primitive* p = n.primitive.get();
  if (dynamic_cast<const Binary*>(p) == nullptr && dynamic_cast<const Scale*>(p) == nullptr &&
      dynamic_cast<const Gelu*>(p) == nullptr && dynamic_cast<const GeluBackward*>(p) == nullptr)
    return false;
  if (n.outputs.size() != 1) return false;
  const Value& o = g.values[static_cast<size_t>(n.outputs[0])];
  if (o.dtype != DType::kF32) return false;
  for (int id : n.inputs) {
    const Value& v = g.values[static_cast<size_t>(id)];
    if (v.dtype != DType::kF32 || v.shape != o.shape || v.view) return false;
  }
  return true;
}

}  // namespace

int64_t fuse_elementwise_chains(Graph& graph) {
  const std::vector<std::vector<int>> readers = readers_by_root(graph);
  std::vector<bool> is_output(graph.values.size(), false);
  for (const auto& [name, id] : graph.outputs) is_output[static_cast<size_t>(id)] = true;
  // A value read by views too is not private to the chain.
  std::vector<bool> viewed(graph.values.size(), false);
  for (const Node& n : graph.nodes)
    if (n.primitive->is_view())
      for (int id : n.inputs) viewed[static_cast<size_t>(root_of(graph, id))] = true;
  std::vector<bool> remove(graph.nodes.size(), false), taken(graph.nodes.size(), false);
  int64_t fused = 0;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    if (taken[i] || !chainable(graph, graph.nodes[i])) continue;
    // Follow the single reader of each result while it is chainable too.
    std::vector<size_t> chain = {i};
    while (true) {
      const int v = graph.nodes[chain.back()].outputs[0];
      const std::vector<int>& r = readers[static_cast<size_t>(v)];
      if (r.size() != 1 || is_output[static_cast<size_t>(v)] || viewed[static_cast<size_t>(v)])
        break;
      const auto next = static_cast<size_t>(r[0]);
      int uses = 0;  // the reader takes the value once (x * x stays two reads of one buffer)
      for (int id : graph.nodes[next].inputs) uses += id == v;
      if (uses != 1 || taken[next] || !chainable(graph, graph.nodes[next])) break;
      chain.push_back(next);
    }
    if (chain.size() < 2) continue;
    // Every step runs at the last one's position: what each reads must be unchanged until then.
    const size_t last = chain.back();
    bool ok = true;
    for (size_t c = 0; c + 1 < chain.size() && ok; ++c)
      for (int id : graph.nodes[chain[c]].inputs)
        ok = ok && !touched_between(graph, chain[c], last + 1, root_of(graph, id), false);
    if (!ok) continue;
    std::vector<int> inputs;
    std::vector<FusedElementwise::Step> steps;
    int64_t scratch = 0;
    for (size_t c = 0; c < chain.size(); ++c) {
      const Node& n = graph.nodes[chain[c]];
      FusedElementwise::Step st{n.primitive, {}};
      for (int id : n.inputs) {
        if (c > 0 && id == graph.nodes[chain[c - 1]].outputs[0]) {
          st.args.push_back(-static_cast<int>(c));  // the previous step's result: -1 - (c - 1)
          continue;
        }
        auto at = std::find(inputs.begin(), inputs.end(), id);
        if (at == inputs.end()) at = inputs.insert(inputs.end(), id);
        st.args.push_back(static_cast<int>(at - inputs.begin()));
      }
      steps.push_back(std::move(st));
      scratch = std::max(scratch, n.scratch_bytes);
    }
    auto p = std::make_shared<FusedElementwise>(std::move(steps));
    Node f;
    f.inputs = std::move(inputs);
    f.outputs = {graph.nodes[last].outputs[0]};
    f.backward = graph.nodes[last].backward;
    f.scratch_bytes = std::max(scratch, p->scratch_bytes(omp_get_max_threads()));
    f.primitive = std::move(p);
    for (size_t c : chain) {
      taken[c] = true;
      remove[c] = c != last;
    }
    graph.nodes[last] = std::move(f);
    ++fused;
  }
  drop(graph, remove);
  return fused;
}

int64_t recompute_layer_norms(Graph& graph) {
  int64_t recomputed = 0;
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    // Each micro-batch's forward is followed by its backward: bwd0 is the first backward node
    // after this one (the first micro-batch's LayerNorms are remade in its backward, the second's
    // in its own).
    if (graph.nodes[i].backward) continue;
    size_t bwd0 = i + 1;
    while (bwd0 < graph.nodes.size() && !graph.nodes[bwd0].backward) ++bwd0;
    if (bwd0 == graph.nodes.size()) break;
    // y: the value the backward reads, the normalised rows or their low-precision cast (under
    // autocast); ln: the node that normalised them, remade by a LayerNorm of `in` (then the cast).
    const Node* cast = nullptr;
    size_t ln = i;
    if (dynamic_cast<const Cast*>(graph.nodes[i].primitive.get()) != nullptr) {
      const Value& src = graph.values[static_cast<size_t>(graph.nodes[i].inputs[0])];
      if (src.view || src.producer < 0) continue;
      cast = &graph.nodes[i];
      ln = static_cast<size_t>(src.producer);
    }
    const Node& node = graph.nodes[ln];
    int y = -1;
    std::vector<int> in;
    float eps = 0;
    if (const auto* l = dynamic_cast<const LayerNorm*>(node.primitive.get())) {
      y = node.outputs[0];
      in = node.inputs;
      eps = l->eps();
    } else if (const auto* aln = dynamic_cast<const AddLayerNorm*>(node.primitive.get())) {
      y = node.outputs[1];
      in = {node.outputs[0], node.inputs[2], node.inputs[3]};
      eps = aln->eps();
    } else {
      continue;
    }
    if (cast != nullptr) {
      if (cast->inputs[0] != y) continue;
      y = cast->outputs[0];
    }
    // The first backward node that reads y, directly or through a view made in the backward; a
    // view of y made in the forward and read in the backward keeps y whole.
    size_t first = graph.nodes.size();
    bool ok = true;
    for (size_t j = i + 1; j < graph.nodes.size() && ok; ++j) {
      const Node& r = graph.nodes[j];
      for (int id : r.inputs) {
        if (root_of(graph, id) != y) continue;
        if (j >= bwd0) {
          first = std::min(first, j);
        } else if (r.primitive->is_view()) {
          for (size_t k = bwd0; k < graph.nodes.size() && ok; ++k)
            for (int o : r.outputs)
              for (int x : graph.nodes[k].inputs) ok = ok && root_of(graph, x) != o;
        }
      }
    }
    if (!ok || first == graph.nodes.size()) continue;
    // What the LayerNorm reads must be unchanged there and still alive after it (remaking y must
    // not keep anything longer than the step already does).
    for (int id : in) {
      const int r = root_of(graph, id);
      ok = ok && !touched_between(graph, ln, first, r, false);
      if (graph.values[static_cast<size_t>(r)].producer < 0) continue;
      bool read_later = false;
      for (size_t j = first + 1; j < graph.nodes.size() && !read_later; ++j)
        for (int x : graph.nodes[j].inputs) read_later = read_later || root_of(graph, x) == r;
      ok = ok && read_later;
    }
    if (!ok) continue;
    auto new_value = [&](int like) {
      Value v = graph.values[static_cast<size_t>(like)];
      v.producer = 0;  // set by renumber
      v.external = Tensor();
      v.view = v.written = false;
      graph.values.push_back(std::move(v));
      return static_cast<int>(graph.values.size() - 1);
    };
    std::vector<Node> again(1);
    again[0].primitive = std::make_shared<LayerNorm>(eps);
    again[0].inputs = in;
    again[0].outputs = {new_value(cast != nullptr ? cast->inputs[0] : y),
                        new_value(node.outputs.back()), new_value(node.outputs.back())};
    if (cast != nullptr) {
      again.emplace_back();
      again[1].primitive = cast->primitive;
      again[1].inputs = {again[0].outputs[0]};
      again[1].outputs = {new_value(y)};
      again[1].scratch_bytes = cast->scratch_bytes;
    }
    for (Node& n : again) n.backward = true;
    const int remade = again.back().outputs[0];
    for (size_t j = first; j < graph.nodes.size(); ++j)
      for (int& id : graph.nodes[j].inputs)
        if (id == y) id = remade;
    for (auto& [name, id] : graph.outputs)
      if (id == y) id = remade;
    graph.nodes.insert(graph.nodes.begin() + static_cast<std::ptrdiff_t>(first),
                       std::make_move_iterator(again.begin()),
                       std::make_move_iterator(again.end()));
    renumber(graph);
    ++recomputed;
  }
  return recomputed;
}

PassReport run_passes(Graph& graph, const PassOptions& options) {
  PassReport r;
  r.nodes_before = static_cast<int64_t>(graph.nodes.size());
  if (options.dead_values) r.rewrites.emplace_back("dead_values", eliminate_dead_values(graph));
  if (options.add_layer_norm) r.rewrites.emplace_back("add_layer_norm", fuse_add_layer_norm(graph));
  if (options.layer_norm_backward_add)
    r.rewrites.emplace_back("layer_norm_backward_add", fuse_layer_norm_backward_add(graph));
  if (options.gelu_backward_sum)
    r.rewrites.emplace_back("gelu_backward_sum", fuse_gelu_backward_sum(graph));
  if (options.cross_entropy) r.rewrites.emplace_back("cross_entropy", fuse_cross_entropy(graph));
  if (options.elementwise) r.rewrites.emplace_back("elementwise", fuse_elementwise_chains(graph));
  if (options.recompute) r.rewrites.emplace_back("recompute", recompute_layer_norms(graph));
  r.nodes_after = static_cast<int64_t>(graph.nodes.size());
  return r;
}

}  // namespace kuai::compiler
