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

OpCost measure_op(const OpRecord& op, int neighbours, double budget_flops, double budget_bytes) {
  OpCost c;
  const Primitive& p = *op.primitive;
  if (op.view || p.host_side()) {
    c.source = "no kernel";
    return c;
  }
  if (op.in.empty()) {  // a creation op: it writes its output
    c.source = "estimated";
    return c;
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
    c.source = "estimated";
    return c;
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
    c.source = "estimated";        // op_seconds prices it from its bytes and FLOPs
    return c;
  }

  // In a step every op's operands come from memory and its outputs go to memory that was not
  // just written (the step's working set is many times the caches): copies of the inputs and
  // outputs that together exceed the last-level cache (up to 128), cycled.
  double op_bytes = 0;
  for (const Tensor& t : probe) op_bytes += double(t.storage()->nbytes);
  for (const TensorSpec& s : specs) op_bytes += double(bytes_of(s));
  const int copies =
      !g_quick
          ? static_cast<int>(std::clamp(
                std::ceil(double(last_level_cache_bytes()) / std::max(1.0, op_bytes)), 1.0, 128.0))
          : 1;
  // The copies are clones of the first set (generating random values anew costs more than the
  // measurement): the same values, in memory of their own.
  auto copy_of = [&probe] {
    std::vector<Tensor> set;
    for (const Tensor& t : probe) {
      const int64_t n = static_cast<int64_t>(t.storage()->nbytes) / dtype_size(t.dtype());
      const Tensor base = clone(Tensor::in_storage(t.storage(), {n}, t.dtype(), 0));
      set.push_back(Tensor::view_of(base, t.shape(), t.strides(), t.offset()));
    }
    return set;
  };
  auto outputs = [&specs] {
    std::vector<Tensor> outs;
    for (const TensorSpec& s : specs) outs.push_back(Tensor::empty(s.shape, s.dtype, kCPU));
    return outs;
  };
  struct Runner {
    std::vector<std::vector<Tensor>> in, out;
    size_t turn = 0;
  };
  // Runner 0 is timed; the others are the neighbours.
  const int runners = 1 + std::clamp(neighbours, 0, 7);
  std::vector<Runner> r(static_cast<size_t>(runners));
  for (int k = 0; k < runners; ++k)
    for (int i = 0; i < copies; ++i) {
      r[k].in.push_back(k == 0 && i == 0 ? probe : copy_of());
      r[k].out.push_back(outputs());
    }
  auto step = [&p](Runner& x) {
    evaluate(p, x.in[x.turn], x.out[x.turn]);
    x.turn = (x.turn + 1) % x.in.size();
  };
  auto run = [&] { step(r[0]); };
  run();  // a new product's calibration, before any neighbour runs
  std::atomic<bool> stop{false};
  std::vector<std::thread> others;
  const int threads = omp_get_max_threads();
  for (int k = 1; k < runners; ++k)
    others.emplace_back([&, k] {
      omp_set_num_threads(threads);
      autograd::NoGradGuard no_grad_here;
      while (!stop.load(std::memory_order_relaxed)) step(r[k]);
    });
  try {
    c.seconds = median_seconds(run, 5) * double(factor);
  } catch (...) {
    stop = true;
    for (std::thread& t : others) t.join();
    throw;
  }
  stop = true;
  for (std::thread& t : others) t.join();
  // The scratch: the most one evaluation takes from the allocator (its outputs exist already),
  // over three: the buffers of an op's threads are live together or not as their timing falls.
  Allocator& alloc = Allocator::get();
  const int64_t before = alloc.stats().current;
  alloc.reset_peak();
  for (int i = 0; i < 3; ++i) run();
  c.scratch = std::max<int64_t>(0, alloc.stats().peak - before);
  c.source =
      factor == 1 ? "measured" : fmt::format("measured on 1/{} of the batch, scaled", factor);
  return c;
}

double op_seconds(const OpRecord& op, const MachineCosts& costs) {
  if (op.view || op.primitive->host_side()) return 0.0;
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
  // Two rounds over the new ops, the faster of each op's two medians kept: a burst of load from
  // another process on a shared machine inflates the ops measured during it, and each op's time
  // counts once per layer and micro-batch.
  std::vector<const OpRecord*> fresh;
  for (const OpRecord& op : trace.ops)
    if (!m.ops.contains(op.key)) {
      m.ops[op.key] = measure_op(op, m.neighbours);
      fresh.push_back(&op);
    }
  if (!g_quick)
    for (const OpRecord* op : fresh) {
      OpCost& c = m.ops[op->key];
      if (c.source == "estimated" || c.source == "no kernel") continue;
      c.seconds = std::min(c.seconds, measure_op(*op, m.neighbours).seconds);
    }
  for (const OpRecord* op : fresh) {
    const OpCost& c = m.ops[op->key];
    if (op->cost.flops > 0 && c.seconds > 0 && c.source != "estimated")
      m.gflops = std::max(m.gflops, op->cost.flops / c.seconds * 1e-9);
  }
}

}  // namespace kuai::plan
