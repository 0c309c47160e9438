// The GEMM router (see router.h): cached choice, else calibration, else the default.
#include "kuai/backend/cpu/gemm/router.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "kuai/backend/cpu/gemm/product_profile.h"
#include "kuai/backend/cpu/gemm/tuning.h"
#include "kuai/core/profiler.h"

namespace kuai::cpu {
namespace {

// After one warm-up run each (which pays for oneDNN's JIT and first-touch packing), the
// candidates run in turn, A B C A B C ..., so that a machine getting busier or quieter affects
// them alike; each keeps its best time. At least kMinRounds rounds, and more until kMinSeconds
// have passed (small products), at most kMaxRounds.
constexpr int kMinRounds = 3;
constexpr int kMaxRounds = 50;
constexpr double kMinSeconds = 20e-3;
// Products below this many multiply-adds (a few microseconds) are not measured: their time is
// mostly call overhead and clock noise, and they are no part of a training step's cost. They take
// the default.
constexpr double kMinCalibratedMacs = double{1 << 20};
// A race is an outlier when its winner's rate is under this fraction of the best rate the cache
// holds for a product of at most as many FLOPs (same op, threads and dtypes): a smaller product
// does not run 1.7x faster than a larger one, but a race run while a neighbour held a core does
// (a shape recorded at 134 GFLOP/s that benched at 290). The race is then run again, after a
// pause, up to kMaxRaces in all, each candidate keeping its best time over them; all before the
// entry is recorded, so every process still reads the one choice made.
constexpr double kOutlierFraction = 0.6;
constexpr int kMaxRaces = 3;

// Function-local, so that training started from a static initializer (a test's child process)
// finds them constructed.
struct FakeTimer {
  std::mutex mu;
  std::function<double(const GemmShape&, const char*)> fn;
};
FakeTimer& fake_timer() {
  static FakeTimer t;
  return t;
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The best time of each candidate, C restored before every run.
std::vector<double> time_candidates(const GemmShape& shape,
                                    std::span<const GemmCandidate> candidates,
                                    const std::function<void()>& restore_c) {
  std::function<double(const GemmShape&, const char*)> fake;
  {
    std::lock_guard<std::mutex> lock(fake_timer().mu);
    fake = fake_timer().fn;
  }
  std::vector<std::function<void()>> runs;
  for (const GemmCandidate& c : candidates) runs.push_back(c.run);
  return race(runs, {kMinRounds, kMaxRounds, kMinSeconds}, restore_c,
              fake ? std::function<double(size_t)>(
                         [&](size_t i) { return fake(shape, candidates[i].name); })
                   : std::function<double(size_t)>());
}

// The FLOPs and the group (the op, threads and dtypes) of a product's key ("gemm NT 4096x768x256
// b1 t2 float32.float32.float32"), and the rate (GFLOP/s) its entry recorded for its choice;
// nullopt for other entries (attention's, the block products', in milliseconds).
struct RecordedRate {
  double flops = 0.0, gflops = 0.0;
  std::string group;
  bool test_clock = false;  // timed by a test's calibration timer, not by this machine
};
constexpr const char* kTestClock = " (test clock)";
std::optional<RecordedRate> recorded_rate(const TuningEntry& e) {
  std::istringstream key(e.key);
  std::string op, trans, mnk, batch, threads, dtypes, rest;
  if (!(key >> op >> trans >> mnk >> batch >> threads >> dtypes) || (key >> rest))
    return std::nullopt;
  long long m = 0, n = 0, k = 0, b = 0;
  char x1 = 0, x2 = 0;
  std::istringstream dims(mnk);
  if (!(dims >> m >> x1 >> n >> x2 >> k) || x1 != 'x' || x2 != 'x') return std::nullopt;
  if (batch.size() < 2 || batch[0] != 'b' || threads.size() < 2 || threads[0] != 't')
    return std::nullopt;
  b = std::atoll(batch.c_str() + 1);
  RecordedRate r;
  r.flops = 2.0 * static_cast<double>(m) * n * k * b;
  r.group = op + " " + threads + " " + dtypes;
  r.test_clock = e.measured.find(kTestClock) != std::string::npos;
  std::istringstream measured(e.measured);  // "onednn 161.2 openblas 150.3 ..."
  std::string name;
  double gflops = 0.0;
  while (measured >> name >> gflops)
    if (name == e.choice) r.gflops = gflops;
  if (r.gflops <= 0.0) return std::nullopt;
  return r;
}

// The best rate recorded for a product of at most `flops` in `group`, timed by the same kind of
// clock (a test's rates are not this machine's); 0 when none.
double best_rate_up_to(TuningCache& cache, double flops, const std::string& group,
                       bool test_clock) {
  double best = 0.0;
  for (const TuningEntry& e : cache.entries()) {
    const auto r = recorded_rate(e);
    if (r && r->group == group && r->test_clock == test_clock && r->flops <= flops)
      best = std::max(best, r->gflops);
  }
  return best;
}

bool test_clock_in_use() {
  std::lock_guard<std::mutex> lock(fake_timer().mu);
  return static_cast<bool>(fake_timer().fn);
}

}  // namespace

std::vector<double> race(std::span<const std::function<void()>> runs, const RaceLimits& limits,
                         const std::function<void()>& before,
                         const std::function<double(size_t)>& fake) {
  std::vector<double> best(runs.size(), std::numeric_limits<double>::infinity());
  for (size_t i = 0; i < runs.size(); ++i) {
    if (before) before();
    runs[i]();  // warm-up
    if (fake) best[i] = fake(i);
  }
  if (fake) return best;
  const double start = seconds_now();
  for (int r = 0; r < limits.max_rounds; ++r) {
    for (size_t i = 0; i < runs.size(); ++i) {
      if (before) before();
      const double t0 = seconds_now();
      runs[i]();
      best[i] = std::min(best[i], seconds_now() - t0);
    }
    if (r + 1 >= limits.min_rounds && seconds_now() - start >= limits.min_seconds) break;
  }
  return best;
}

bool routes_to_default_here() { return omp_get_level() > 0; }

void run_profiled(const GemmShape& shape, const char* impl, const std::function<void()>& fn) {
  if (!profiler::enabled() || routes_to_default_here()) return fn();
  const double t0 = seconds_now();
  fn();
  const double ms = (seconds_now() - t0) * 1e3;
  const std::string row = fmt::format(
      "{} {}{} {}x{}x{}{} {}", shape.op, shape.trans_a ? 'T' : 'N', shape.trans_b ? 'T' : 'N',
      shape.m, shape.n, shape.k, shape.batch > 1 ? fmt::format(" b{}", shape.batch) : "", impl);
  profiler::record(row, ms, shape.flops());
  note_profiled_product(row, shape, impl, ms);
}

std::string routing_key(const GemmShape& s) {
  return fmt::format("{} {}{} {}x{}x{} b{} t{} {}.{}.{}", s.op, s.trans_a ? 'T' : 'N',
                     s.trans_b ? 'T' : 'N', s.m, s.n, s.k, s.batch, omp_get_max_threads(),
                     dtype_name(s.a), dtype_name(s.b), dtype_name(s.c));
}

size_t route(const GemmShape& shape, std::span<const GemmCandidate> candidates, size_t fallback,
             const std::function<void()>& save_c, const std::function<void()>& restore_c) {
  if (candidates.size() <= 1) return 0;
  TuningCache& cache = TuningCache::get();
  if (!cache.enabled() || routes_to_default_here()) return fallback;
  const std::string key = routing_key(shape);
  auto index_of = [&](const std::string& name) -> std::optional<size_t> {
    for (size_t i = 0; i < candidates.size(); ++i)
      if (name == candidates[i].name) return i;
    return std::nullopt;
  };
  if (const auto cached = cache.find(key)) {
    if (const auto i = index_of(*cached)) return *i;
  }
  if (!cache.may_calibrate() || shape.flops() / 2 < kMinCalibratedMacs) return fallback;
  if (save_c) save_c();
  std::vector<double> times = time_candidates(shape, candidates, restore_c);
  const std::string group = std::string(shape.op) + key.substr(key.find(" t"));  // "gemm t2 ..."
  const bool test_clock = test_clock_in_use();
  const double reference = best_rate_up_to(cache, shape.flops(), group, test_clock);
  int races = 1;
  for (; races < kMaxRaces; ++races) {
    const double fastest = *std::min_element(times.begin(), times.end());
    if (shape.flops() / std::max(fastest, 1e-12) * 1e-9 >= kOutlierFraction * reference) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const std::vector<double> again = time_candidates(shape, candidates, restore_c);
    for (size_t i = 0; i < times.size(); ++i) times[i] = std::min(times[i], again[i]);
  }
  size_t best = fallback;
  double best_s = std::numeric_limits<double>::infinity();
  std::string measured;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const double s = times[i];
    measured += fmt::format("{}{} {:.1f}", measured.empty() ? "" : " ", candidates[i].name,
                            shape.flops() / std::max(s, 1e-12) * 1e-9);
    if (s < best_s) {  // ties keep the earlier candidate: the order is fixed
      best_s = s;
      best = i;
    }
  }
  if (races > 1) measured += fmt::format(" races {}", races);
  if (test_clock) measured += kTestClock;
  if (restore_c) restore_c();
  const std::string stands = cache.record({key, candidates[best].name, measured});
  return index_of(stands).value_or(best);
}

MatrixSnapshot::MatrixSnapshot(void* c, int64_t rows, int64_t cols, int64_t ld, size_t elem)
    : c_(static_cast<char*>(c)),
      rows_(rows),
      row_bytes_(static_cast<size_t>(cols) * elem),
      ld_bytes_(static_cast<size_t>(ld) * elem) {}

std::function<void()> MatrixSnapshot::save_fn() {
  if (c_ == nullptr) return {};
  return [this] {
    if (!copy_) copy_.emplace(row_bytes_ * static_cast<size_t>(rows_));
    char* dst = static_cast<char*>(copy_->data());
    for (int64_t r = 0; r < rows_; ++r)
      std::memcpy(dst + r * row_bytes_, c_ + r * ld_bytes_, row_bytes_);
  };
}

std::function<void()> MatrixSnapshot::restore_fn() {
  if (c_ == nullptr) return {};
  return [this] {
    const char* src = static_cast<const char*>(copy_->data());
    for (int64_t r = 0; r < rows_; ++r)
      std::memcpy(c_ + r * ld_bytes_, src + r * row_bytes_, row_bytes_);
  };
}

std::string gemm_routing_report() {
  TuningCache& cache = TuningCache::get();
  if (!cache.enabled()) {
    return "gemm      tuning off (KUAI_GEMM_TUNING=off): fp32 on oneDNN; bf16/f16 on oneDNN "
           "on AMX, else the packed kernel (avx2), else widened to fp32\n";
  }
  std::string out = fmt::format("gemm      tuning cache {}{}\n", cache.path(),
                                cache.may_calibrate() ? "" : " (read only: one of several ranks)");
  const auto entries = cache.entries();
  if (entries.empty())
    out += "          (no product measured yet: `kuai tune` measures a step's)\n";
  for (const TuningEntry& e : entries) {  // products in GFLOP/s; attention's entries in ms
    if (!recorded_rate(e)) {
      out += fmt::format("          {:<46} -> {:<8} ({})\n", e.key, e.choice, e.measured);
      continue;
    }
    std::istringstream fields(e.measured);
    std::string rates, name, value;
    int races = 1;
    while (fields >> name >> value) {
      if (name == "races")
        races = std::atoi(value.c_str());
      else if (name[0] != '(')
        rates += fmt::format("{}{} {}", rates.empty() ? "" : " ", name, value);
    }
    out +=
        fmt::format("          {:<46} -> {:<8} ({} GFLOP/s{}{})\n", e.key, e.choice, rates,
                    races > 1 ? fmt::format("; best of {} races, the first an outlier", races) : "",
                    recorded_rate(e)->test_clock ? "; a test's clock" : "");
  }
  return out;
}

void set_calibration_timer(std::function<double(const GemmShape&, const char*)> timer) {
  std::lock_guard<std::mutex> lock(fake_timer().mu);
  fake_timer().fn = std::move(timer);
}

}  // namespace kuai::cpu
