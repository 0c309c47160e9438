// The GEMM tuning cache (see tuning.h).
#include "kuai/backend/cpu/gemm/tuning.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "kuai/backend/cpu/gemm/libraries.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/core/version.h"

namespace kuai::cpu {
namespace {

constexpr const char* kFormat = "kuai-gemm-tuning 1";

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

bool launched_as_one_of_several_ranks() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* v = std::getenv(var);
    if (v != nullptr && std::atoi(v) > 1) return true;
  }
  return false;
}

std::string default_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return std::string(x) + "/kuai";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0')
    return std::string(h) + "/.cache/kuai";
  return "/tmp/kuai-cache";
}

}  // namespace

TuningCache& TuningCache::get() {
  static TuningCache cache;
  return cache;
}

// The set of choices the cache may hold, and what they were measured on. A cache measured when
// the router had fewer candidates (before oneDNN over slices of K, before attention's entries),
// or when a candidate ran differently (3: oneDNN's per-call cost cut, which made attention's
// per-head kernels faster; 4: flash attention's row maximum and row tails vectorised, its forward
// 1.2-1.7x faster; 5: flash's backward may run its products on the small GEMM, 1.3-1.5x faster
// where it does; 6: kuai's blocked GEMM a candidate for every fp32 product; 7: its transposed A
// packed a few rows at a time, TN products of 1024 rows 1.15x faster), would keep its old answers
// for ever, entries never being replaced: a new set is a new file.
constexpr int kChoiceSet = 7;

TuningCache::TuningCache() {
  const GemmLibraries& libs = gemm_libraries();
  const CpuId& id = cpu_id();
  fingerprint_ = fmt::format(
      "cpu={}|{}|family {} model {} stepping {}|tier={}|onednn={}|openblas={} "
      "{}|kuai={}|choices={}",
      id.vendor, id.model_name, id.family, id.model, id.stepping, isa_name(isa()),
      libs.onednn_version, libs.openblas_config, libs.openblas_core, kKuaiVersion, kChoiceSet);
  const char* env = std::getenv("KUAI_GEMM_TUNING");
  const std::string setting = env != nullptr ? env : "";
  if (setting == "off" || setting == "0") return;  // disabled
  enabled_ = true;
  multi_rank_ = launched_as_one_of_several_ranks();
  path_ = !setting.empty() && setting != "on" && setting != "1"
              ? setting
              : fmt::format("{}/gemm-{:016x}.tsv", default_dir(), fnv1a(fingerprint_));
  std::lock_guard<std::mutex> lock(mu_);
  load_locked();
}

// Reads the file's entries into memory (keeping what is there: the first choice of a key
// stands). A file of another fingerprint (KUAI_GEMM_TUNING naming one file for several machines)
// is ignored and will be replaced.
void TuningCache::load_locked() {
  std::ifstream in(path_);
  std::string line;
  if (!in || !std::getline(in, line) || line != kFormat) return;
  if (!std::getline(in, line) || line != "# " + fingerprint_) return;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    TuningEntry e;
    if (!std::getline(fields, e.key, '\t') || !std::getline(fields, e.choice, '\t')) continue;
    std::getline(fields, e.measured, '\t');
    if (index_.count(e.key) != 0) continue;
    index_.emplace(e.key, entries_.size());
    entries_.push_back(std::move(e));
  }
}

void TuningCache::save_locked() {
  std::error_code ec;
  const std::filesystem::path path(path_);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  const std::string tmp = fmt::format("{}.tmp.{}", path_, getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return;  // an unwritable cache only costs a calibration next time
    out << kFormat << "\n# " << fingerprint_ << "\n";
    for (const TuningEntry& e : entries_)
      out << e.key << '\t' << e.choice << '\t' << e.measured << '\n';
    if (!out.flush()) {
      std::filesystem::remove(tmp, ec);
      return;
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::filesystem::remove(tmp, ec);
}

std::optional<std::string> TuningCache::find(const std::string& key) {
  if (!enabled_) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it == index_.end()) return std::nullopt;
  return entries_[it->second].choice;
}

std::string TuningCache::record(const TuningEntry& entry) {
  std::lock_guard<std::mutex> lock(mu_);
  load_locked();  // another process may have measured it meanwhile: its choice stands
  auto it = index_.find(entry.key);
  if (it != index_.end()) return entries_[it->second].choice;
  index_.emplace(entry.key, entries_.size());
  entries_.push_back(entry);
  save_locked();
  return entry.choice;
}

std::vector<TuningEntry> TuningCache::entries() {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_;
}

void TuningCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.clear();
  index_.clear();
  if (!path_.empty()) {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
}

}  // namespace kuai::cpu
