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

void record(std::string_view op, double ms) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.table.find(op);
  if (it == s.table.end()) it = s.table.emplace(std::string(op), Entry{}).first;
  it->second.calls++;
  it->second.ms += ms;
}

std::string report() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::pair<std::string, Entry>> rows(s.table.begin(), s.table.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0;
  for (const auto& r : rows) total += r.second.ms;
  std::string out = fmt::format("{:<24} {:>8} {:>11} {:>9} {:>6}\n", "op", "calls", "total ms",
                                "mean ms", "share");
  for (const auto& [name, e] : rows)
    out += fmt::format("{:<24} {:>8} {:>11.1f} {:>9.3f} {:>5.1f}%\n", name, e.calls, e.ms,
                       e.ms / static_cast<double>(e.calls), total > 0 ? 100.0 * e.ms / total : 0.0);
  return out;
}

void reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.table.clear();
}

}  // namespace kuai::profiler
