// Each profiled product of a step timed again alone, hot and cold (see product_profile.h).
#include "kuai/backend/cpu/gemm/product_profile.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/core/allocator.h"
#include "kuai/core/profiler.h"
#include "kuai/core/rng.h"

namespace kuai::cpu {
namespace {

struct Noted {
  GemmShape shape;
  std::string impl;
  int64_t calls = 0;
  double ms = 0;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, Noted> products;  // by the profile's row name
};

Registry& registry() {
  static Registry r;
  return r;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Bytes that evict every cache: twice the last-level cache, at least 64 MiB, at most 512 MiB (a
// VM may report its whole host's L3, of which its cores see a slice).
int64_t sweep_bytes() {
  for (int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long v = sysconf(name);
    if (v > 0) return std::clamp<int64_t>(2 * int64_t{v}, int64_t{64} << 20, int64_t{512} << 20);
  }
  return int64_t{64} << 20;
}

// Writes every line of a sweep_bytes() buffer: whatever the product had in any cache is gone,
// and the lines it will read come from memory.
class CacheSweep {
 public:
  CacheSweep()
      : n_(static_cast<size_t>(sweep_bytes()) / sizeof(int64_t)), buf_(n_ * sizeof(int64_t)) {
    std::memset(buf_.data(), 1, n_ * sizeof(int64_t));
  }
  void run() {
    auto* p = static_cast<int64_t*>(buf_.data());
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n_; i += 8) p[i] += 1;  // one write per 64-byte line
  }

 private:
  size_t n_;
  ScratchBytes buf_;
};

// The mean, as the in-step figure is the mean over the step's calls (a median would leave out
// the slow runs that the step's mean includes).
double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

// Runs the noted product on operands of its shape with the implementation it ran in the step.
class Product {
 public:
  explicit Product(const Noted& p) : p_(p) {
    const GemmShape& s = p.shape;
    const int64_t per_a = s.m * s.k, per_b = s.k * s.n, per_c = s.m * s.n;
    Generator g(7, 0);
    a_ = g.normal({per_a * s.batch});
    b_ = g.normal({per_b * s.batch});
    c_ = g.normal({per_c * s.batch});
    bias_ = g.normal({s.n});
    for (int64_t i = 0; i < s.batch; ++i) {
      a_off_.push_back(i * per_a);
      b_off_.push_back(i * per_b);
      c_off_.push_back(i * per_c);
    }
  }

  void run() {
    const GemmShape& s = p_.shape;
    const int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    const float *a = a_.data<float>(), *b = b_.data<float>();
    float* c = c_.data<float>();
    const std::string_view op = s.op;
    // The other implementations (a batch's "loop", oneDNN over slices of K) are the router's
    // recorded choice for the shape: automatic mode runs them again.
    GemmBackend forced = p_.impl == "openblas" ? GemmBackend::kOpenBLAS
                         : p_.impl == "onednn" ? GemmBackend::kOneDNN
                         : p_.impl == "kuai"   ? GemmBackend::kKuai
                                               : GemmBackend::kAuto;
    set_gemm_backend(forced);
    if (op == "bias")
      gemm_bias(s.trans_a, s.trans_b, s.m, s.n, s.k, a, lda, b, ldb, bias_.data<float>(), c, s.n);
    else if (op == "batched")
      gemm_batched(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a, lda, a_off_.data(), b, ldb,
                   b_off_.data(), 0.0f, c, s.n, c_off_.data(), s.batch);
    else
      gemm(s.trans_a, s.trans_b, s.m, s.n, s.k, 1.0f, a, lda, b, ldb, 0.0f, c, s.n);
    set_gemm_backend(GemmBackend::kAuto);
  }

 private:
  const Noted& p_;
  Tensor a_, b_, c_, bias_;
  std::vector<int64_t> a_off_, b_off_, c_off_;
};

bool is_fp32(const GemmShape& s) {
  const std::string_view op = s.op;
  return s.a == DType::kF32 && s.b == DType::kF32 && s.c == DType::kF32 &&
         (op == "gemm" || op == "bias" || op == "batched");
}

}  // namespace

void note_profiled_product(const std::string& row, const GemmShape& shape, const char* impl,
                           double ms) {
  static const bool registered = [] {
    profiler::add_section("products alone", products_alone_report, [] {
      Registry& r = registry();
      std::lock_guard<std::mutex> lock(r.mu);
      r.products.clear();
    });
    return true;
  }();
  (void)registered;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  Noted& n = r.products[row];
  if (n.calls == 0) {
    n.shape = shape;
    n.impl = impl;
  }
  n.calls++;
  n.ms += ms;
}

std::string products_alone_report() {
  std::vector<std::pair<std::string, Noted>> rows;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    rows.assign(r.products.begin(), r.products.end());
  }
  if (rows.empty()) return {};
  std::sort(rows.begin(), rows.end(),
            [](const auto& x, const auto& y) { return x.second.ms > y.second.ms; });
  size_t width = 24;
  for (const auto& r : rows) width = std::max(width, r.first.size());
  std::string out = fmt::format(
      "\nproducts alone (each run again on fresh operands, same implementation; hot: right after "
      "itself, cold: after a {:.0f} MiB sweep; means of 5-9 runs), GFLOP/s:\n",
      static_cast<double>(sweep_bytes()) / (1 << 20));
  out += fmt::format("{:<{}} {:>6} {:>10} {:>8} {:>8} {:>8} {:>9} {:>9}\n", "product", width,
                     "calls", "step ms", "in step", "hot", "cold", "step/hot", "step/cold");
  CacheSweep sweep;
  double step_ms = 0, hot_ms = 0, cold_ms = 0, other_ms = 0;
  for (const auto& [name, p] : rows) {
    const double per_call = p.ms / static_cast<double>(p.calls);
    const double flops = p.shape.flops();
    const double in_step = flops / per_call * 1e-6;
    if (!is_fp32(p.shape)) {
      out += fmt::format("{:<{}} {:>6} {:>10.1f} {:>8.1f} {:>8} {:>8}\n", name, width, p.calls,
                         p.ms, in_step, "-", "-");
      other_ms += p.ms;
      continue;
    }
    Product product(p);
    product.run();  // warm-up: the implementation's first-use costs, the operands' pages
    std::vector<double> hot, cold;
    const double start = now_s();
    for (int r = 0; r < 9; ++r) {
      sweep.run();
      double t0 = now_s();
      product.run();
      cold.push_back(now_s() - t0);
      t0 = now_s();
      product.run();
      hot.push_back(now_s() - t0);
      if (r >= 4 && now_s() - start > 0.5) break;
    }
    const double hot_rate = flops / mean(hot) * 1e-9, cold_rate = flops / mean(cold) * 1e-9;
    out += fmt::format("{:<{}} {:>6} {:>10.1f} {:>8.1f} {:>8.1f} {:>8.1f} {:>9.2f} {:>9.2f}\n",
                       name, width, p.calls, p.ms, in_step, hot_rate, cold_rate, in_step / hot_rate,
                       in_step / cold_rate);
    step_ms += p.ms;
    hot_ms += static_cast<double>(p.calls) * mean(hot) * 1e3;
    cold_ms += static_cast<double>(p.calls) * mean(cold) * 1e3;
  }
  out += fmt::format(
      "fp32 products: {:.1f} ms in the steps; alone they take {:.1f} ms hot ({:.2f}x), {:.1f} ms "
      "cold ({:.2f}x)",
      step_ms, hot_ms, hot_ms / std::max(step_ms, 1e-9), cold_ms,
      cold_ms / std::max(step_ms, 1e-9));
  out += other_ms > 0 ? fmt::format("; low-precision products {:.1f} ms (not rerun)\n", other_ms)
                      : std::string("\n");
  return out;
}

}  // namespace kuai::cpu
