// `kuai launch`'s decisions between attempts (see launch.h).
#include "kuai/train/launch.h"

#include <fmt/format.h>

#include <filesystem>
#include <regex>
#include <sstream>
#include <stdexcept>

#include "kuai/train/checkpoint.h"

namespace kuai::train {

std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& file_name) {
  std::vector<HostSlots> hosts;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string word;
    HostSlots h;
    while (words >> word) {
      if (h.host.empty()) {
        h.host = word;
        continue;
      }
      const size_t eq = word.find('=');
      const std::string key = word.substr(0, eq);
      if (key != "slots") continue;  // max_slots and the like: not a count of ranks
      try {
        size_t used = 0;
        h.slots = std::stoi(word.substr(eq + 1), &used);
        if (used != word.size() - eq - 1 || h.slots < 1) throw std::invalid_argument("");
      } catch (const std::exception&) {
        throw std::invalid_argument(
            fmt::format("{}:{}: '{}': slots must be a positive integer", file_name, number, word));
      }
    }
    if (!h.host.empty()) hosts.push_back(h);
  }
  if (hosts.empty()) throw std::invalid_argument(fmt::format("{}: names no host", file_name));
  return hosts;
}

std::string format_hostfile(const std::vector<HostSlots>& hosts) {
  std::string out;
  for (const HostSlots& h : hosts) out += fmt::format("{} slots={}\n", h.host, h.slots);
  return out;
}

std::optional<BatchSplit> keep_global_batch(int64_t batch_size, int64_t accum_steps, int64_t world,
                                            int64_t new_world) {
  if (batch_size < 1 || accum_steps < 1 || world < 1 || new_world < 1)
    throw std::invalid_argument("keep_global_batch: sizes must be positive");
  if (new_world == world) return BatchSplit{batch_size, accum_steps};
  const int64_t global = batch_size * accum_steps * world;
  for (const bool even : {true, false})
    for (int64_t b = batch_size; b >= 1; --b)
      if ((b % 2 == 0) == even && global % (b * new_world) == 0)
        return BatchSplit{b, global / (b * new_world)};
  return std::nullopt;
}

namespace {
bool contains(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }
// kuai's line naming the ranks (and hosts) that never reached a collective or no longer answer,
// or its deadline.
bool names_missing_ranks(const std::string& s) {
  return contains(s, "never reached it") || contains(s, "did not complete within") ||
         contains(s, "no longer answer");
}
// mpirun's own report of a process that died or a daemon it lost.
bool reports_a_lost_process(const std::string& s) {
  return contains(s, "noticed that process rank") || contains(s, "lost communication") ||
         contains(s, "ORTE was unable") || contains(s, "An ORTE daemon has");
}
}  // namespace

bool names_a_failure(const std::string& line) {
  return names_missing_ranks(line) || reports_a_lost_process(line) ||
         contains(line, "MPI_ABORT was invoked");
}

std::string failure_cause(const std::vector<std::string>& lines) {
  // In order of how much each says: kuai's line naming the ranks that never came (with their
  // hosts) or its deadline; a failed checkpoint; mpirun's own report of a process that died or a
  // daemon it lost; then any error line.
  using Test = bool (*)(const std::string&);
  const Test ranked[] = {
      names_missing_ranks,
      [](const std::string& s) {
        return contains(s, "checkpoint") && (contains(s, "fail") || contains(s, "error"));
      },
      reports_a_lost_process,
      [](const std::string& s) { return contains(s, "error:") || contains(s, "Error:"); },
      [](const std::string& s) { return s.rfind("kuai: ", 0) == 0; },
  };
  for (const Test test : ranked)
    for (const std::string& line : lines)
      if (test(line)) return line;
  return {};
}

std::string short_cause(const std::string& cause) {
  // kuai's lines: "...; ranks that never reached it: 1 (on node1), 2 (on node2). Aborting..." and
  // "...; rank 1 (on node1) never reached it: ..." and "...: 0 (on node0). Aborting the run."
  static const std::regex never(R"(ranks? that never reached it: ([^.;]*))");
  static const std::regex never_one(
      R"(ranks? (\d+ \(on [^)]*\)(?:, \d+ \(on [^)]*\))*) never reached it)");
  static const std::regex silent(R"(do not answer \([^)]*\): ([^.;]*))");
  static const std::regex gone(
      R"(ranks? (\d+ \(on [^)]*\)(?:, \d+ \(on [^)]*\))*) no longer answers?)");
  static const std::regex deadline(
      R"(collective #(\d+) \(([^)]*)\) did not complete within ([0-9.]+ s))");
  static const std::regex mpirun(
      R"(process rank (\d+) with PID \d+ on node (\S+) (exited on signal \d+[^.]*|exited))");
  std::smatch m;
  std::string what;
  if (std::regex_search(cause, m, deadline))
    what =
        fmt::format("collective #{} ({}) timed out after {}", m[1].str(), m[2].str(), m[3].str());
  auto add = [&](const std::string& part) { what += (what.empty() ? "" : "; ") + part; };
  if (std::regex_search(cause, m, never) || std::regex_search(cause, m, never_one))
    add(fmt::format("never reached it: rank {}", m[1].str()));
  if (std::regex_search(cause, m, silent)) add(fmt::format("no answer from rank {}", m[1].str()));
  if (std::regex_search(cause, m, gone))
    add(fmt::format("rank {} died inside a collective", m[1].str()));
  if (std::regex_search(cause, m, mpirun))
    add(fmt::format("rank {} on {} {}", m[1].str(), m[2].str(), m[3].str()));
  if (!what.empty()) return what;
  return cause.size() > 160 ? cause.substr(0, 157) + "..." : cause;
}

int64_t latest_checkpoint_step(const std::string& run_dir) {
  try {
    if (!std::filesystem::is_regular_file(run_dir + "/latest")) return -1;
    return checkpoint_step_of(std::filesystem::path(resolve_checkpoint(run_dir)).filename());
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace kuai::train
