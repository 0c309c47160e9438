// Liveness and best-fit placement of a captured step's intermediates (see memory_plan.h).
#include "kuai/compile/memory_plan.h"

#include <algorithm>
#include <numeric>

namespace kuai::compiler {

namespace {

int64_t aligned(int64_t bytes) {
  const int64_t a = MemoryPlan::kAlignment;
  return std::max<int64_t>(a, (bytes + a - 1) / a * a);
}

int64_t value_bytes(const Value& v) { return shape_numel(v.shape) * dtype_size(v.dtype); }

}  // namespace

std::vector<int> last_uses(const Graph& graph) {
  std::vector<int> last(graph.values.size(), -1);
  for (size_t i = 0; i < graph.nodes.size(); ++i)
    for (int id : graph.nodes[i].inputs) last[static_cast<size_t>(id)] = static_cast<int>(i);
  for (const auto& [name, id] : graph.outputs)
    last[static_cast<size_t>(id)] = static_cast<int>(graph.nodes.size());
  return last;
}

MemoryPlan plan_memory(const Graph& graph, bool in_place) {
  const size_t n = graph.values.size();
  const std::vector<int> last = last_uses(graph);
  // The value each view aliases (itself when it is not a view); views come after their bases.
  std::vector<int> root(n);
  std::iota(root.begin(), root.end(), 0);
  for (size_t v = 0; v < n; ++v)
    if (graph.values[v].view && graph.values[v].producer >= 0) {
      const Node& node = graph.nodes[static_cast<size_t>(graph.values[v].producer)];
      root[v] = root[static_cast<size_t>(node.inputs[0])];
    }
  // A root's end: the last use of itself or of any view of it.
  std::vector<int> end(n, -1);
  for (size_t v = 0; v < n; ++v) {
    int& e = end[static_cast<size_t>(root[v])];
    e = std::max(e, last[v]);
  }
  std::vector<bool> is_output(n, false);
  for (const auto& [name, id] : graph.outputs) is_output[static_cast<size_t>(id)] = true;
  // An output's views escape with it: their root stays outside the arena too.
  for (size_t v = 0; v < n; ++v)
    if (is_output[v]) is_output[static_cast<size_t>(root[v])] = true;
  auto planned = [&](size_t v) {
    const Value& x = graph.values[v];
    return x.producer >= 0 && !x.view && !is_output[v];
  };

  MemoryPlan plan;
  plan.offset.assign(n, -1);
  plan.buffer_of.assign(n, -1);
  plan.dies_after.resize(graph.nodes.size());
  for (size_t i = 0; i < graph.nodes.size(); ++i) {
    const Node& node = graph.nodes[i];
    const int here = static_cast<int>(i);
    std::vector<bool> taken(node.inputs.size(), false);
    for (size_t j = 0; j < node.outputs.size(); ++j) {
      const auto v = static_cast<size_t>(node.outputs[j]);
      if (!planned(v)) continue;
      // A value nothing reads still needs its buffer while its node runs.
      const int v_end = std::max(here, end[v]);
      const int r = in_place ? node.primitive->in_place_input(j) : -1;
      if (r >= 0 && static_cast<size_t>(r) < node.inputs.size() && !taken[static_cast<size_t>(r)]) {
        const auto u = static_cast<size_t>(node.inputs[static_cast<size_t>(r)]);
        const int b = plan.buffer_of[u];
        if (b >= 0 && root[u] == static_cast<int>(u) &&
            plan.buffers[static_cast<size_t>(b)].last == here &&
            graph.values[u].shape == graph.values[v].shape &&
            graph.values[u].dtype == graph.values[v].dtype) {
          taken[static_cast<size_t>(r)] = true;
          plan.buffer_of[v] = b;
          plan.buffers[static_cast<size_t>(b)].last = v_end;
          ++plan.inplace_reuses;
          continue;
        }
      }
      plan.buffer_of[v] = static_cast<int>(plan.buffers.size());
      plan.buffers.push_back({aligned(value_bytes(graph.values[v])), 0, here, v_end});
    }
    plan.scratch_of.push_back(-1);
    if (node.scratch_bytes > 0) {
      plan.scratch_of.back() = static_cast<int>(plan.buffers.size());
      plan.buffers.push_back({aligned(node.scratch_bytes), 0, here, here});
    }
  }

  // Bytes live at each node (the lower bound), and what dies after each.
  const size_t nb = plan.buffers.size();
  const size_t nn = graph.nodes.size();
  {
    std::vector<int64_t> live(nn + 1, 0);
    for (size_t b = 0; b < nb; ++b) {
      const MemoryPlan::Buffer& buf = plan.buffers[b];
      for (int i = buf.first; i <= std::min<int>(buf.last, static_cast<int>(nn) - 1); ++i)
        live[static_cast<size_t>(i)] += buf.bytes;
      if (buf.last < static_cast<int>(nn))
        plan.dies_after[static_cast<size_t>(buf.last)].push_back(static_cast<int>(b));
    }
    plan.lower_bound = *std::max_element(live.begin(), live.end());
  }

  // Best fit in three orders: largest first, longest-lived first, largest area (bytes x lifetime)
  // first; the smallest arena wins (ties: the earlier order).
  auto span_of = [&](const MemoryPlan::Buffer& x) { return int64_t{x.last - x.first + 1}; };
  auto sorted_by = [&](auto&& before) {
    std::vector<int> order(nb);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return before(plan.buffers[static_cast<size_t>(a)], plan.buffers[static_cast<size_t>(b)]);
    });
    return order;
  };
  std::vector<std::vector<int>> orders;
  orders.push_back(sorted_by([](const auto& x, const auto& y) { return x.bytes > y.bytes; }));
  orders.push_back(
      sorted_by([&](const auto& x, const auto& y) { return span_of(x) > span_of(y); }));
  orders.push_back(sorted_by(
      [&](const auto& x, const auto& y) { return x.bytes * span_of(x) > y.bytes * span_of(y); }));
  // Places the buffers in `order`, each in the smallest gap that holds it among the buffers placed
  // before it whose lifetimes overlap its own (or on top); returns the arena's size.
  std::vector<std::pair<int64_t, int64_t>> busy;  // [begin, end) of overlapping placed buffers
  auto place = [&](const std::vector<int>& order, std::vector<int64_t>& offsets) {
    offsets.assign(nb, 0);
    int64_t top = 0;
    for (size_t k = 0; k < order.size(); ++k) {
      const MemoryPlan::Buffer& buf = plan.buffers[static_cast<size_t>(order[k])];
      busy.clear();
      for (size_t j = 0; j < k; ++j) {
        const MemoryPlan::Buffer& q = plan.buffers[static_cast<size_t>(order[j])];
        if (q.first <= buf.last && buf.first <= q.last)
          busy.emplace_back(offsets[static_cast<size_t>(order[j])],
                            offsets[static_cast<size_t>(order[j])] + q.bytes);
      }
      std::sort(busy.begin(), busy.end());
      int64_t best = -1, best_gap = 0, cursor = 0;
      for (const auto& [lo, hi] : busy) {
        if (lo - cursor >= buf.bytes && (best < 0 || lo - cursor < best_gap)) {
          best = cursor;
          best_gap = lo - cursor;
        }
        cursor = std::max(cursor, hi);
      }
      offsets[static_cast<size_t>(order[k])] = best >= 0 ? best : cursor;
      top = std::max(top, offsets[static_cast<size_t>(order[k])] + buf.bytes);
    }
    return top;
  };
  std::vector<int64_t> best_offsets, offsets;
  std::vector<int> best_order;
  plan.arena_bytes = -1;
  for (std::vector<int>& order : orders) {
    const int64_t top = place(order, offsets);
    if (plan.arena_bytes < 0 || top < plan.arena_bytes) {
      plan.arena_bytes = top;
      best_offsets = offsets;
      best_order = order;
    }
  }
  // Then a bounded local search from the best order: swap two buffers of the order, keep the swap
  // when the arena does not grow (a fixed seed: the plan is the same every time). The budget
  // bounds the work to about 1e7 overlap checks whatever the graph's size.
  if (nb > 1 && plan.arena_bytes > plan.lower_bound) {
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    auto next = [&] {
      seed ^= seed << 13;
      seed ^= seed >> 7;
      seed ^= seed << 17;
      return seed;
    };
    const int64_t tries = std::min<int64_t>(200, 10000000 / static_cast<int64_t>(nb * nb) + 1);
    std::vector<int> order = best_order;
    for (int64_t t = 0; t < tries && plan.arena_bytes > plan.lower_bound; ++t) {
      const size_t i = next() % nb, j = next() % nb;
      if (i == j) continue;
      std::swap(order[i], order[j]);
      const int64_t top = place(order, offsets);
      if (top <= plan.arena_bytes) {
        plan.arena_bytes = top;
        best_offsets = offsets;
      } else {
        std::swap(order[i], order[j]);
      }
    }
  }
  plan.arena_bytes = std::max<int64_t>(plan.arena_bytes, 0);
  for (size_t b = 0; b < nb; ++b) {
    plan.buffers[b].offset = best_offsets.empty() ? 0 : best_offsets[b];
    plan.planned_bytes += plan.buffers[b].bytes;
  }
  for (size_t v = 0; v < n; ++v)
    if (plan.buffer_of[v] >= 0)
      plan.offset[v] = plan.buffers[static_cast<size_t>(plan.buffer_of[v])].offset;

  return plan;
}

}  // namespace kuai::compiler
