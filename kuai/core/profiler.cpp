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
  double bytes = 0;
};

struct State {
  bool on =
      std::getenv("KUAI_PROFILE") != nullptr && std::string(std::getenv("KUAI_PROFILE")) != "0";
  std::mutex mu;
  std::map<std::string, Entry, std::less<>> table;
  struct Section {
    std::function<std::string()> report;
    std::function<void()> reset;
  };
  std::map<std::string, Section> sections;
};

State& state() {
  static State s;
  return s;
}

}  // namespace

bool enabled() { return state().on; }
void enable(bool on) { state().on = on; }

void record(std::string_view op, double ms, double flops, double bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.table.find(op);
  if (it == s.table.end()) it = s.table.emplace(std::string(op), Entry{}).first;
  it->second.calls++;
  it->second.ms += ms;
  it->second.flops += flops;
  it->second.bytes += bytes;
}

std::string report(double bandwidth_gbs) {
  State& s = state();
  std::vector<std::pair<std::string, Entry>> rows;
  std::vector<std::function<std::string()>> sections;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    rows.assign(s.table.begin(), s.table.end());
    for (const auto& [name, section] : s.sections) sections.push_back(section.report);
  }
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0;
  for (const auto& r : rows) total += r.second.ms;
  size_t width = 24;
  for (const auto& r : rows) width = std::max(width, r.first.size());
  const bool bw = bandwidth_gbs > 0;
  std::string out = fmt::format("{:<{}} {:>8} {:>11} {:>9} {:>6} {:>8} {:>7}", "op", width, "calls",
                                "total ms", "mean ms", "share", "GFLOP/s", "GB/s");
  out += bw ? fmt::format(" {:>9} {:>7}\n", "at bw ms", "x at bw") : "\n";
  for (const auto& [name, e] : rows) {
    const std::string rate =
        e.flops > 0 && e.ms > 0 ? fmt::format("{:.1f}", e.flops / e.ms * 1e-6) : std::string();
    const std::string gbs =
        e.bytes > 0 && e.ms > 0 ? fmt::format("{:.1f}", e.bytes / e.ms * 1e-6) : std::string();
    out += fmt::format("{:<{}} {:>8} {:>11.1f} {:>9.3f} {:>5.1f}% {:>8} {:>7}", name, width,
                       e.calls, e.ms, e.ms / static_cast<double>(e.calls),
                       total > 0 ? 100.0 * e.ms / total : 0.0, rate, gbs);
    if (bw && e.bytes > 0) {
      const double at_bw_ms = e.bytes / (bandwidth_gbs * 1e9) * 1e3;
      out += fmt::format(" {:>9.1f} {:>7.2f}\n", at_bw_ms, e.ms / at_bw_ms);
    } else {
      out += "\n";
    }
  }
  if (bw)
    out += fmt::format(
        "(GB/s: the op's bytes read and written (Primitive::cost) over its time; at bw: those "
        "bytes at the measured memory bandwidth, {:.1f} GB/s)\n",
        bandwidth_gbs);
  if (!sections.empty()) {
    const bool was_on = enabled();
    enable(false);
    for (const auto& section : sections) out += section();
    enable(was_on);
  }
  return out;
}

void add_section(std::string name, std::function<std::string()> section,
                 std::function<void()> on_reset) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sections[std::move(name)] = {std::move(section), std::move(on_reset)};
}

void reset() {
  State& s = state();
  std::vector<std::function<void()>> resets;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.table.clear();
    for (const auto& [name, section] : s.sections)
      if (section.reset) resets.push_back(section.reset);
  }
  for (const auto& r : resets) r();
}

}  // namespace kuai::profiler
