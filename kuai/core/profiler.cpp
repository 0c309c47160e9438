// The dispatch-point profiler (see profiler.h).
#include "kuai/core/profiler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

namespace kuai::profiler {
namespace {

struct Entry {
  int64_t calls = 0;
  double ms = 0;
  double flops = 0;
};

struct State {
  bool on =
      std::getenv("KUAI_PROFILE") != nullptr && std::string(std::getenv("KUAI_PROFILE")) != "0";
  std::mutex mu;
  std::map<std::string, Entry, std::less<>> table;
};

State& state() {
  static State s;
  return s;
}

}  // namespace

bool enabled() { return state().on; }
void enable(bool on) { state().on = on; }

void record(std::string_view op, double ms, double flops) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.table.find(op);
  if (it == s.table.end()) it = s.table.emplace(std::string(op), Entry{}).first;
  it->second.calls++;
  it->second.ms += ms;
  it->second.flops += flops;
}

std::string report() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::pair<std::string, Entry>> rows(s.table.begin(), s.table.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0;
  for (const auto& r : rows) total += r.second.ms;
  size_t width = 24;
  for (const auto& r : rows) width = std::max(width, r.first.size());
  std::string out = fmt::format("{:<{}} {:>8} {:>11} {:>9} {:>6} {:>8}\n", "op", width, "calls",
                                "total ms", "mean ms", "share", "GFLOP/s");
  for (const auto& [name, e] : rows) {
    const std::string rate =
        e.flops > 0 && e.ms > 0 ? fmt::format("{:.1f}", e.flops / e.ms * 1e-6) : std::string();
    out += fmt::format("{:<{}} {:>8} {:>11.1f} {:>9.3f} {:>5.1f}% {:>8}\n", name, width, e.calls,
                       e.ms, e.ms / static_cast<double>(e.calls),
                       total > 0 ? 100.0 * e.ms / total : 0.0, rate);
  }
  return out;
}

void reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.table.clear();
}

}  // namespace kuai::profiler
