// The GEMM tuning cache: the implementation measured fastest for each product shape on this
// machine, kept in memory and in a file that later runs read. The file is per machine kind: its
// name carries a hash of the CPU (vendor, family, model, stepping, brand), the ISA tier in force,
// the oneDNN and OpenBLAS versions and cores and kuai's version, so a cache is never applied to
// another CPU, tier or library (each entry's key has the OpenMP thread count). Location:
// $KUAI_GEMM_TUNING when it names a file; `off` (or 0) disables tuning (the router's defaults then,
// see router.h); else
// ${XDG_CACHE_HOME:-$HOME/.cache}/kuai/gemm-<hash>.tsv. Entries are written as they are measured
// (the file rewritten atomically: temporary file, rename), and an entry already in the file is
// never replaced, so every process that reads it makes the same choice. `kuai tune` clears it.
#pragma once

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace kuai::cpu {

struct TuningEntry {
  std::string key;       // "gemm NT 4096x768x256 b1 t2 f32.f32.f32"
  std::string choice;    // "onednn"
  std::string measured;  // "onednn 161.2 openblas 150.3" (GFLOP/s), for reports
};

class TuningCache {
 public:
  static TuningCache& get();

  bool enabled() const { return enabled_; }
  // Calibration is allowed: tuning on and not one of several MPI ranks (ranks must agree on
  // every choice; they read the cache, `kuai tune` fills it).
  bool may_calibrate() const { return enabled_ && !multi_rank_; }
  const std::string& path() const { return path_; }
  const std::string& fingerprint() const { return fingerprint_; }

  std::optional<std::string> find(const std::string& key);
  // Records a measured choice (kept if another process recorded the key first: returns the
  // choice that stands).
  std::string record(const TuningEntry& entry);
  std::vector<TuningEntry> entries();
  // Forgets every entry, in memory and on disk.
  void clear();

 private:
  TuningCache();
  void load_locked();
  void save_locked();

  bool enabled_ = false, multi_rank_ = false;
  std::string path_, fingerprint_;
  std::vector<TuningEntry> entries_;               // in insertion order, for a stable file
  std::unordered_map<std::string, size_t> index_;  // key -> position in entries_
  std::mutex mu_;
};

}  // namespace kuai::cpu
