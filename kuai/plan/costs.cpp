// This machine's measured costs (see costs.h).
#include "kuai/plan/costs.h"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>

#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
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

Tensor random(const Shape& shape, DType dtype, uint64_t seed) {
  Generator g(seed, 7);
  Tensor x = g.normal(shape, 0.0f, 0.5f);
  return dtype == DType::kF32 ? x : cast(x, dtype);
}

// p's dimensions scaled down alike (none below 64 or its own size) until it is within budget.
Product proxy_of(const Product& p, double budget) {
  Product q = p;
  for (int i = 0; i < 64 && q.flops() > budget; ++i) {
    int64_t* dims[] = {&q.m, &q.n, &q.k};
    int64_t* big = *std::max_element(std::begin(dims), std::end(dims),
                                     [](int64_t* a, int64_t* b) { return *a < *b; });
    if (*big <= 64) break;
    *big = std::max<int64_t>(64, *big * 3 / 4 / 16 * 16);
  }
  return q;
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

std::string product_key(const Product& p) {
  return fmt::format("{} {}{} {}x{}x{} b{} {}.{}.{}", p.bias ? "bias" : "gemm",
                     p.trans_a ? 'T' : 'N', p.trans_b ? 'T' : 'N', p.m, p.n, p.k, p.batch,
                     dtype_name(p.a), dtype_name(p.b), dtype_name(p.c));
}

std::string attention_key(const AttentionWork& a) {
  return fmt::format("{} B{} H{} Hkv{} T{} d{} {}", a.flash ? "flash" : "naive", a.B, a.H, a.Hkv,
                     a.T, a.d, dtype_name(a.dtype));
}

ProductCost measure_product(const Product& p, double budget_flops) {
  autograd::NoGradGuard no_grad;
  const Product q = proxy_of(p, budget_flops);
  // In a training step a product's operands come from memory, not from the cache the previous
  // run of the same product left them in: the runs cycle through copies that together exceed
  // the last-level cache (up to 16 of them).
  const double operand_bytes =
      double(q.m * q.k) * double(dtype_size(q.a)) + double(q.k * q.n) * double(dtype_size(q.b));
  const int copies =
      g_quick ? 1
              : static_cast<int>(std::clamp(
                    std::ceil(double(last_level_cache_bytes()) / operand_bytes), 1.0, 16.0));
  std::vector<Tensor> As, Bs;
  for (int i = 0; i < copies; ++i) {
    As.push_back(random(q.trans_a ? Shape{q.k, q.m} : Shape{q.m, q.k}, q.a, 1 + 2 * i));
    Bs.push_back(random(q.trans_b ? Shape{q.n, q.k} : Shape{q.k, q.n}, q.b, 2 + 2 * i));
  }
  const Tensor bias = q.bias ? random({q.n}, q.c, 3) : Tensor();
  int turn = 0;
  auto run = [&] {
    const Tensor& A = As[static_cast<size_t>(turn)];
    const Tensor& B = Bs[static_cast<size_t>(turn)];
    turn = (turn + 1) % copies;
    if (q.trans_b) return linear(q.trans_a ? transpose(A, 0, 1) : A, B, bias);
    return matmul(q.trans_a ? transpose(A, 0, 1) : A, B);
  };
  ProductCost c;
  c.seconds = median_seconds([&] { (void)run(); }, 5);
  // The scratch: what the product takes from the allocator besides its output.
  Allocator& alloc = Allocator::get();
  const int64_t before = alloc.stats().current;
  alloc.reset_peak();
  const Tensor out = run();
  c.scratch = std::max<int64_t>(
      0, alloc.stats().peak - before - static_cast<int64_t>(Allocator::round_size(out.nbytes())));
  c.gflops = q.flops() / c.seconds * 1e-9;
  // What the router's tuning cache says of the shape: the implementation that ran and the rates
  // it measured for each candidate.
  const bool lowp = q.a != DType::kF32 || q.b != DType::kF32;
  const cpu::GemmShape shape{lowp ? (q.bias ? "lowp_bias" : "lowp") : (q.bias ? "bias" : "gemm"),
                             q.trans_a,
                             q.trans_b,
                             q.m,
                             q.n,
                             q.k,
                             q.batch,
                             q.a,
                             q.b,
                             q.c};
  const std::string key = cpu::routing_key(shape);
  for (const cpu::TuningEntry& e : cpu::TuningCache::get().entries())
    if (e.key == key) c.routed = fmt::format("{} ({} GFLOP/s)", e.choice, e.measured);
  if (q.m != p.m || q.n != p.n || q.k != p.k) {
    c.seconds = p.flops() / (c.gflops * 1e9);
    c.source = fmt::format("proxy {}x{}x{}", q.m, q.n, q.k);
  } else {
    c.source = "measured";
  }
  return c;
}

AttentionCost measure_attention(const AttentionWork& a, double budget_flops) {
  // Scaled down over the batch, then the key/value groups: the cost is linear in both.
  AttentionWork w = a;
  const int64_t group = std::max<int64_t>(1, a.H / std::max<int64_t>(1, a.Hkv));
  while (w.B > 1 && (w.flops_fwd + w.flops_bwd) * double(w.B) / double(a.B) > budget_flops) --w.B;
  auto flops_of = [&](const AttentionWork& x) {
    return (a.flops_fwd + a.flops_bwd) * double(x.B * x.H) / double(a.B * a.H);
  };
  while (w.Hkv > 1 && flops_of(w) > budget_flops) {
    --w.Hkv;
    w.H = w.Hkv * group;
  }
  // Still too long for one head: a shorter sequence (multiple of 128), scaled by the causal
  // (query, key) pairs, which the kernels' time follows once the blocks are large.
  auto pairs = [](int64_t T) { return double(T) * double(T + 1) / 2.0; };
  while (w.T > 256 && flops_of(w) * pairs(w.T) / pairs(a.T) > budget_flops)
    w.T = std::max<int64_t>(256, (w.T * 3 / 4) / 128 * 128);
  const int64_t width = w.H + 2 * w.Hkv;
  Tensor qkv = random({w.B, w.T, width, w.d}, w.dtype, 4);
  Tensor gy = random({w.B, w.T, w.H, w.d}, w.dtype, 5);
  auto forward = [&](const Tensor& x) {
    std::vector<Tensor> parts = split(x, {w.H, w.Hkv, w.Hkv}, 2);
    for (Tensor& t : parts) t = transpose(t, 1, 2);
    Tensor y = w.flash ? flash_attention(parts[0], parts[1], parts[2], true)
                       : scaled_dot_product_attention(parts[0], parts[1], parts[2], true);
    return y;  // (B, H, T, d) view of (B, T, H, d)
  };
  AttentionCost c;
  {
    autograd::NoGradGuard no_grad;
    c.fwd_s = median_seconds([&] { (void)forward(qkv); }, 3);
  }
  Tensor leaf = qkv.detach();
  leaf.requires_grad_(true);
  const double both = median_seconds(
      [&] {
        Tensor y = forward(leaf);
        autograd::backward(y, transpose(gy, 1, 2));
        leaf.set_grad(Tensor());
      },
      3);
  c.bwd_s = std::max(0.0, both - c.fwd_s);
  const double scale = double(a.B * a.H) / double(w.B * w.H) * pairs(a.T) / pairs(w.T);
  c.fwd_s *= scale;
  c.bwd_s *= scale;
  c.source =
      scale == 1.0 ? "measured" : fmt::format("measured at B {} H {} T {}, scaled", w.B, w.H, w.T);
  return c;
}

std::string kernel_key(const Pass& p) {
  std::string shape;
  for (int64_t d : p.shape) shape += fmt::format("{}{}", shape.empty() ? "" : "x", d);
  return fmt::format("{} {} {}.{}{}", p.kernel, shape, dtype_name(p.from), dtype_name(p.dtype),
                     p.kernel == "rope" ? fmt::format(" r{}", p.rotated) : "");
}

double pass_seconds(const Pass& p, const MachineCosts& costs) {
  if (!p.kernel.empty()) {
    const auto it = costs.kernels.find(kernel_key(p));
    if (it != costs.kernels.end()) return p.backward ? it->second.bwd_s : it->second.fwd_s;
  }
  return p.bytes / (costs.bandwidth.at(p.bytes) * 1e9);
}

KernelCost measure_kernel(const Pass& p_in) {
  // Large kernels are measured on fewer rows (their time is linear in the rows) and scaled: at
  // most ~32 MiB of input.
  Pass p = p_in;
  double scale = 1.0;
  {
    const size_t rows_dim = p.kernel == "embedding" ? 2 : 0;
    double bytes = double(dtype_size(p.dtype));
    for (int64_t d : p.shape) bytes *= double(d);
    if (p.kernel == "embedding") bytes = double(p.shape[1] * p.shape[2]) * 4;
    const double cap = double(int64_t{32} << 20);
    if (bytes > cap && !p.shape.empty()) {
      int64_t& rows = p.shape[rows_dim];
      const int64_t was = rows;
      rows = std::max<int64_t>(1, static_cast<int64_t>(double(rows) * cap / bytes));
      if (p.kernel == "rope" && rows == 1 && was > 1) {  // (B, T, heads, d): shorten T too
        const double left = bytes / double(was) / cap;
        if (left > 1)
          p.shape[1] = std::max<int64_t>(1, static_cast<int64_t>(double(p.shape[1]) / left));
        scale = double(was) * double(p_in.shape[1]) / double(p.shape[1]);
      } else {
        scale = double(was) / double(rows);
      }
    }
  }
  const std::vector<int64_t>& s = p.shape;
  Generator g(11, 3);
  std::vector<Tensor> leaves;  // inputs that get gradients
  std::vector<Tensor> consts;
  std::function<Tensor()> f;
  auto leaf = [&](const Shape& shape, DType dt) {
    Tensor t = random(shape, dt, 20 + leaves.size()).detach();
    leaves.push_back(t);
    return t;
  };
  if (p.kernel == "layer_norm" || p.kernel == "rms_norm") {
    const Tensor x = leaf({s[0], s[1]}, p.dtype);
    const Tensor w = full({s[1]}, 1.0f), b = zeros({s[1]});
    if (p.kernel == "layer_norm")
      f = [x, w, b] { return layer_norm(x, w, b); };
    else
      f = [x, w] { return rms_norm(x, w); };
  } else if (p.kernel == "gelu" || p.kernel == "swiglu") {
    const Tensor x = leaf(Shape(s.begin(), s.end()), p.dtype);
    f = p.kernel == "gelu" ? std::function<Tensor()>([x] { return gelu(x); })
                           : std::function<Tensor()>([x] { return swiglu(x); });
  } else if (p.kernel == "rope") {
    const Tensor x = leaf(Shape(s.begin(), s.end()), p.dtype);
    const double theta = p.theta;
    const int64_t rotated = p.rotated;
    f = [x, theta, rotated] { return rope(x, theta, rotated); };
  } else if (p.kernel == "add") {
    const Tensor a = leaf({s[0]}, p.from), b = leaf({s[0]}, p.dtype);
    f = [a, b] { return add(a, b); };
  } else if (p.kernel == "cast") {
    const Tensor x = leaf({s[0]}, p.from);
    const DType to = p.dtype;
    f = [x, to] { return cast(x, to); };
  } else if (p.kernel == "sum_rows") {
    const Tensor x = leaf({s[0], s[1]}, p.dtype);
    f = [x] { return sum(x, 0); };
  } else if (p.kernel == "embedding") {
    const Tensor w = leaf({s[0], s[1]}, DType::kF32);
    const Tensor idx = g.randint({s[2]}, 0, static_cast<int32_t>(s[0]));
    f = [w, idx] { return embedding(w, idx); };
  } else if (p.kernel == "cross_entropy") {
    const Tensor x = leaf({s[0], s[1]}, p.dtype);
    const Tensor t = g.randint({s[0]}, 0, static_cast<int32_t>(s[1]));
    f = [x, t] { return cross_entropy(x, t); };
  } else {
    throw std::invalid_argument("plan: no kernel '" + p.kernel + "' to measure");
  }
  KernelCost c;
  {
    autograd::NoGradGuard no_grad;
    c.fwd_s = median_seconds([&] { (void)f(); }, 5);
  }
  for (Tensor& t : leaves) t.requires_grad_(true);
  const Tensor y0 = f();
  const Tensor gy = y0.numel() == 1 ? Tensor() : random(y0.shape(), y0.dtype(), 99);
  const double both = median_seconds(
      [&] {
        const Tensor y = f();
        if (gy.defined())
          autograd::backward(y, gy);
        else
          autograd::backward(y, Tensor());
        for (Tensor& t : leaves) t.set_grad(Tensor());
      },
      5);
  c.bwd_s = std::max(0.0, both - c.fwd_s) * scale;
  c.fwd_s *= scale;
  return c;
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
  const Tensor a = full({16}, 1.0f), b = full({16}, 2.0f);
  return median_seconds([&] { (void)add(a, b); }, 5);
}

void measure_costs(const StepModel& step, MachineCosts& m) {
  if (m.cpu.empty()) {
    m.threads = omp_get_max_threads();
    m.cpu = fmt::format("{} (family {} model {}), tier {}, {} threads", cpu::cpu_id().model_name,
                        cpu::cpu_id().family, cpu::cpu_id().model, cpu::isa_name(cpu::isa()),
                        m.threads);
    m.bandwidth = measure_bandwidth();
    m.op_overhead_s = measure_op_overhead();
  }
  for (const Product& p : step.products) {
    const std::string key = product_key(p);
    if (!m.products.contains(key)) m.products[key] = measure_product(p);
  }
  for (const AttentionWork& a : step.attention) {
    const std::string key = attention_key(a);
    if (!m.attention.contains(key)) m.attention[key] = measure_attention(a);
  }
  for (const Pass& p : step.passes)
    if (!p.kernel.empty() && !m.kernels.contains(kernel_key(p)))
      m.kernels[kernel_key(p)] = measure_kernel(p);
}

}  // namespace kuai::plan
