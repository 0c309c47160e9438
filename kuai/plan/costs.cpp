// This machine's measured costs (see costs.h).
#include "kuai/plan/costs.h"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <set>
#include <thread>

#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/backend.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"

namespace kuai::plan {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool g_quick = false;

// The median of `reps` timed runs of fn after one untimed run (which may calibrate the GEMM
// router for a new shape), each run repeated until it lasts at least `min_s`.
double median_seconds(const std::function<void()>& fn, int reps, double min_s = 2e-3) {
  fn();
  if (g_quick) {
    reps = 1;
    min_s = 0;
  }
  int inner = 1;
  for (;;) {
    const double t0 = now_s();
    for (int i = 0; i < inner; ++i) fn();
    const double t = now_s() - t0;
    if (t >= min_s || inner >= (1 << 16)) break;
    inner *= t > 0 ? std::clamp(static_cast<int>(min_s / t * 1.5), 2, 64) : 64;
  }
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now_s();
    for (int i = 0; i < inner; ++i) fn();
    t.push_back((now_s() - t0) / inner);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

bool is_float(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

int64_t bytes_of(const TensorSpec& s) {
  int64_t n = dtype_size(s.dtype);
  for (int64_t d : s.shape) n *= d;
  return n;
}

int64_t elements_needed(const Layout& l) {
  int64_t last = l.offset;
  for (size_t i = 0; i < l.shape.size(); ++i) {
    if (l.shape[i] == 0) return l.offset;
    last += (l.shape[i] - 1) * l.strides[i];
  }
  return last + 1;
}

// The op's batch cut by `factor`: every input that is not a weight and whose leading dimension
// is the first such input's. False when there is nothing to cut.
bool slice_batch(std::vector<Layout>& in, int64_t& factor) {
  int64_t B = -1;
  for (const Layout& l : in)
    if (!l.weight && !l.shape.empty()) {
      B = l.shape[0];
      break;
    }
  if (B <= 1) return false;
  factor = std::min(factor, B);
  const int64_t b = std::max<int64_t>(1, B / factor);
  factor = B / b;
  for (Layout& l : in)
    if (!l.weight && !l.shape.empty() && l.shape[0] == B) {
      l.shape[0] = b;
      l.storage_elements = elements_needed(l);
    }
  return true;
}

// CPU tensors laid out as `in` says: floats drawn from N(0, 0.5), integers (indices, targets)
// uniform below the smallest dimension of the float operands, so they are valid for any lookup
// or loss the op does.
std::vector<Tensor> make_inputs(const std::vector<Layout>& in, uint64_t seed) {
  int64_t bound = int64_t{1} << 30;
  for (const Layout& l : in)
    if (is_float(l.dtype))
      for (int64_t d : l.shape) bound = std::min(bound, std::max<int64_t>(1, d));
  Generator g(seed, 7);
  std::vector<Tensor> out;
  for (const Layout& l : in) {
    const int64_t n = std::max<int64_t>(1, l.storage_elements);
    Tensor base;
    if (is_float(l.dtype)) {
      base = g.normal({n}, 0.0f, 0.5f, kCPU);
      if (l.dtype != DType::kF32) base = cast(base, l.dtype);
    } else if (l.dtype == DType::kI32) {
      base = g.randint({n}, 0, static_cast<int32_t>(std::min<int64_t>(bound, 1 << 30)), kCPU);
    } else {
      base = zeros({n}, l.dtype, kCPU);
    }
    out.push_back(Tensor::view_of(base, l.shape, l.strides, l.offset));
  }
  return out;
}

}  // namespace

void set_quick_measurements(bool on) { g_quick = on; }

int64_t last_level_cache_bytes() {
  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long v = sysconf(name);
    if (v > 0) return std::min<int64_t>(v, int64_t{256} << 20);
  }
  return int64_t{32} << 20;
}

double BandwidthCurve::at(double bytes) const {
  if (points.empty()) return 1.0;
  if (bytes <= points.front().first) return points.front().second;
  if (bytes >= points.back().first) return points.back().second;
  for (size_t i = 1; i < points.size(); ++i)
    if (bytes <= points[i].first) {
      const auto& [x0, y0] = points[i - 1];
      const auto& [x1, y1] = points[i];
      const double f = std::log(bytes / x0) / std::log(x1 / x0);
      return y0 + f * (y1 - y0);
    }
  return points.back().second;
}

namespace {

// An op made ready to run here: its (sliced) inputs, its outputs' specs, the slice factor; or
// why it is not run (cost.source "no kernel" or "estimated").
struct Prepared {
  const OpRecord* op = nullptr;
  OpCost cost;
  int64_t factor = 1;
  std::vector<Tensor> probe;
  std::vector<TensorSpec> specs;
  double bytes = 0;  // one set of its inputs and outputs
  bool runs() const { return !probe.empty() || !specs.empty(); }
};

Prepared prepare_op(const OpRecord& op, double budget_flops, double budget_bytes) {
  Prepared r;
  r.op = &op;
  const Primitive& p = *op.primitive;
  if (op.view || p.host_side()) {
    r.cost.source = "no kernel";
    return r;
  }
  if (op.cost.disk_read + op.cost.disk_written > 0) {  // streams files: priced at the disk's rate
    r.cost.source = "disk";
    return r;
  }
  if (op.in.empty()) {  // a creation op: it writes its output
    r.cost.source = "estimated";
    return r;
  }
  autograd::NoGradGuard no_grad;
  // The activations' bytes (weights are not sliced) and the FLOPs decide the slice.
  double act_bytes = 0;
  for (const Layout& l : op.in)
    if (!l.weight) act_bytes += double(elements_needed(l)) * double(dtype_size(l.dtype));
  for (const TensorSpec& s : op.out) act_bytes += double(bytes_of(s));
  const double over = std::max(op.cost.flops / budget_flops, act_bytes / budget_bytes);
  std::vector<Layout> in = op.in;
  int64_t factor = 1;
  if (over > 1) {
    factor = static_cast<int64_t>(std::ceil(over));
    if (!slice_batch(in, factor)) factor = 1;
  }
  // What running it here would allocate, after the slice (which cuts only the inputs whose
  // leading dimension is the batch: a multi-tensor op over every gradient is not cut): beyond 4
  // budgets, it is priced from its bytes and FLOPs instead, so planning a model larger than this
  // machine's memory never needs that memory.
  double held = 0;
  for (const Layout& l : in) held += double(elements_needed(l)) * double(dtype_size(l.dtype));
  for (const TensorSpec& s : op.out) held += double(bytes_of(s)) / double(factor);
  if (held > 4 * budget_bytes) {
    r.cost.source = "estimated";
    return r;
  }
  std::vector<Tensor> probe = make_inputs(in, 1);
  std::vector<TensorSpec> specs;
  try {
    specs = p.infer(probe);
  } catch (const std::exception&) {
    if (factor == 1) throw;
    in = op.in;  // the slice does not fit the op: whole, or at the bandwidth
    factor = 1;
    probe = make_inputs(in, 1);
    specs = p.infer(probe);
  }
  if (factor == 1 && over > 64) {  // too large to run here, and no batch to slice
    r.cost.source = "estimated";   // op_seconds prices it from its bytes and FLOPs
    return r;
  }
  for (const Tensor& t : probe) r.bytes += double(t.storage()->nbytes);
  for (const TensorSpec& s : specs) r.bytes += double(bytes_of(s));
  r.factor = factor;
  r.probe = std::move(probe);
  r.specs = std::move(specs);
  r.cost.source =
      factor == 1 ? "measured" : fmt::format("measured on 1/{} of the batch, scaled", factor);
  return r;
}

// Times a group of prepared ops as a step runs them: one after another, in the step's order,
// each evaluation timed on its own, for several passes (the median kept). An op timed back to
// back with itself runs with its code, branch history and threads warm, and comes out faster than
// in the step (the step's bf16 products 0.86 ms against 0.67); here each follows a different op.
// Every op runs on copies of its inputs and outputs such that the group's data exceeds twice the
// last-level cache (up to 128 copies), cycled: in a step the working set is many times the
// caches, so an op reads its operands from memory and writes to memory it did not just write.
// `neighbours` threads run the same group on copies of their own meanwhile, as the other ranks
// of a run on one host do. Then each op's scratch, with nothing beside it.
void time_group(std::vector<Prepared*>& group, int neighbours) {
  if (group.empty()) return;
  autograd::NoGradGuard no_grad;
  double group_bytes = 0;
  for (const Prepared* x : group) group_bytes += x->bytes;
  const int copies =
      g_quick ? 1
              : static_cast<int>(std::clamp(
                    std::ceil(2.0 * double(last_level_cache_bytes()) / std::max(1.0, group_bytes)),
                    1.0, 128.0));
  struct Sets {
    std::vector<std::vector<Tensor>> in, out;
    size_t turn = 0;
  };
  // The copies are clones of the first set (generating random values anew costs more than the
  // measurement): the same values, in memory of their own.
  auto copy_of = [](const std::vector<Tensor>& probe) {
    std::vector<Tensor> set;
    for (const Tensor& t : probe) {
      const int64_t n = static_cast<int64_t>(t.storage()->nbytes) / dtype_size(t.dtype());
      const Tensor base = clone(Tensor::in_storage(t.storage(), {n}, t.dtype(), 0));
      set.push_back(Tensor::view_of(base, t.shape(), t.strides(), t.offset()));
    }
    return set;
  };
  const int runners = 1 + std::clamp(neighbours, 0, 7);  // runner 0 is timed
  std::vector<std::vector<Sets>> sets(static_cast<size_t>(runners),
                                      std::vector<Sets>(group.size()));
  for (int k = 0; k < runners; ++k)
    for (size_t j = 0; j < group.size(); ++j)
      for (int i = 0; i < copies; ++i) {
        Sets& s = sets[k][j];
        s.in.push_back(k == 0 && i == 0 ? group[j]->probe : copy_of(group[j]->probe));
        std::vector<Tensor> outs;
        for (const TensorSpec& o : group[j]->specs)
          outs.push_back(Tensor::empty(o.shape, o.dtype, kCPU));
        s.out.push_back(std::move(outs));
      }
  auto run = [&](int k, size_t j) {
    Sets& s = sets[k][j];
    evaluate(*group[j]->op->primitive, s.in[s.turn], s.out[s.turn]);
    s.turn = (s.turn + 1) % s.in.size();
  };
  // Untimed first: one pass over every copy, so that a new product is calibrated, primitives are
  // created, buffers grown and every copy's pages are mapped (a page fault is no part of a step's
  // op: the allocator's cache hands it memory already touched).
  for (int i = 0; i < copies; ++i)
    for (size_t j = 0; j < group.size(); ++j) run(0, j);
  std::atomic<bool> stop{false};
  std::atomic<int> ready_neighbours{0};
  std::vector<std::thread> others;
  const int threads = omp_get_max_threads();
  for (int k = 1; k < runners; ++k)
    others.emplace_back([&, k] {
      omp_set_num_threads(threads);
      autograd::NoGradGuard no_grad_here;
      // A neighbour that fails stops (the timed runner's own run reports the op's error).
      bool ok = true;
      try {
        for (int i = 0; i < copies; ++i)  // its pages mapped, as the timed runner's
          for (size_t j = 0; j < group.size(); ++j) run(k, j);
      } catch (const std::exception&) {
        ok = false;
      }
      ready_neighbours.fetch_add(1);
      try {
        while (ok && !stop.load(std::memory_order_relaxed))
          for (size_t j = 0; j < group.size(); ++j) run(k, j);
      } catch (const std::exception&) {
      }
    });
  while (ready_neighbours.load() < runners - 1) std::this_thread::yield();
  const int passes = g_quick ? 1 : 9;
  std::vector<std::vector<double>> times(group.size());
  try {
    for (int pass = 0; pass < passes; ++pass)
      for (size_t j = 0; j < group.size(); ++j) {
        const double t0 = now_s();
        run(0, j);
        times[j].push_back(now_s() - t0);
      }
  } catch (...) {
    stop = true;
    for (std::thread& t : others) t.join();
    throw;
  }
  stop = true;
  for (std::thread& t : others) t.join();
  Allocator& alloc = Allocator::get();
  for (size_t j = 0; j < group.size(); ++j) {
    std::sort(times[j].begin(), times[j].end());
    group[j]->cost.seconds = times[j][times[j].size() / 2] * double(group[j]->factor);
    // The scratch: the most one evaluation takes from the allocator (its outputs exist
    // already), over three: the buffers of an op's threads are live together or not as their
    // timing falls.
    const int64_t before = alloc.stats().current;
    alloc.reset_peak();
    for (int i = 0; i < 3; ++i) run(0, j);
    group[j]->cost.scratch = std::max<int64_t>(0, alloc.stats().peak - before);
  }
}

}  // namespace

OpCost measure_op(const OpRecord& op, int neighbours, double budget_flops, double budget_bytes) {
  Prepared x = prepare_op(op, budget_flops, budget_bytes);
  if (x.runs()) {
    std::vector<Prepared*> group = {&x};
    time_group(group, neighbours);
  }
  return x.cost;
}

double op_seconds(const OpRecord& op, const MachineCosts& costs) {
  if (op.view || op.primitive->host_side()) return 0.0;
  if (op.cost.disk_read + op.cost.disk_written > 0) {
    // Offloaded state: the pass reads and writes the files while it updates (a pipeline), so it
    // takes the longer of its disk I/O and its memory traffic.
    const double bytes = double(op.cost.bytes_read + op.cost.bytes_written);
    return std::max(bytes / (costs.bandwidth.at(bytes) * 1e9),
                    costs.disk.seconds(double(op.cost.disk_read), double(op.cost.disk_written)));
  }
  const auto it = costs.ops.find(op.key);
  if (it != costs.ops.end() && it->second.source != "estimated") return it->second.seconds;
  const double bytes = double(op.cost.bytes_read + op.cost.bytes_written);
  const double memory = bytes / (costs.bandwidth.at(bytes) * 1e9);
  return costs.gflops > 0 ? std::max(memory, op.cost.flops / (costs.gflops * 1e9)) : memory;
}

BandwidthCurve measure_bandwidth() {
  BandwidthCurve curve;
  for (int64_t total : {int64_t{3} << 16, int64_t{3} << 20, int64_t{3} << 23, int64_t{3} << 26}) {
    const int64_t n = total / 12;
    std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n), 1.0f),
        c(static_cast<size_t>(n), 2.0f);
    float* pa = a.data();
    const float* pb = b.data();
    const float* pc = c.data();
    const double s = median_seconds(
        [&] {
#pragma omp parallel for schedule(static) if (n > 65536)
          for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.0f * pc[i];
        },
        5);
    curve.points.emplace_back(double(12 * n), 12.0 * double(n) / s * 1e-9);
  }
  return curve;
}

double measure_op_overhead() {
  autograd::NoGradGuard no_grad;
  const Tensor a = full({16}, 1.0f, DType::kF32, kCPU), b = full({16}, 2.0f, DType::kF32, kCPU);
  return median_seconds([&] { (void)add(a, b); }, 5);
}

void measure_costs(const StepTrace& trace, MachineCosts& m) {
  if (m.cpu.empty()) {
    m.threads = omp_get_max_threads();
    m.cpu = fmt::format("{}, {} threads", backend_for(kCPU).describe(), m.threads);
    m.bandwidth = measure_bandwidth();
    m.op_overhead_s = measure_op_overhead();
  }
  // The new ops in the step's order, prepared, then timed in groups of consecutive ops whose
  // data stays within a bound (the step's order is kept within a group; each group's data is
  // made, timed and freed before the next).
  std::vector<const OpRecord*> fresh;
  std::set<std::string> seen;
  for (const OpRecord& op : trace.ops)
    if (!m.ops.contains(op.key) && seen.insert(op.key).second) fresh.push_back(&op);
  // Each neighbour holds copies of its own: the bound is shared among them.
  const double bound = std::max(4.0 * double(last_level_cache_bytes()), double(int64_t{1} << 30)) /
                       double(1 + std::clamp(m.neighbours, 0, 7));
  std::vector<Prepared> ready(fresh.size());
  std::vector<Prepared*> group;
  double group_bytes = 0;
  auto flush = [&] {
    time_group(group, m.neighbours);
    for (Prepared* x : group) {  // its data freed before the next group is made
      x->probe.clear();
      x->specs.clear();
    }
    group.clear();
    group_bytes = 0;
    // and given back: the caching allocator would otherwise keep a block of every size measured
    // (a wide model's step has hundreds), and the planner's own memory would grow with them.
    Allocator::get().empty_cache();
  };
  for (size_t i = 0; i < fresh.size(); ++i) {
    ready[i] = prepare_op(*fresh[i], kSliceFlops, double(int64_t{256} << 20));
    if (!ready[i].runs()) continue;
    if (!group.empty() && group_bytes + ready[i].bytes > bound) flush();
    group.push_back(&ready[i]);
    group_bytes += ready[i].bytes;
  }
  flush();
  for (const Prepared& x : ready) {
    m.ops[x.op->key] = x.cost;
    if (x.op->cost.flops > 0 && x.cost.seconds > 0 && x.cost.source != "estimated")
      m.gflops = std::max(m.gflops, x.op->cost.flops / x.cost.seconds * 1e-9);
  }
}

}  // namespace kuai::plan
