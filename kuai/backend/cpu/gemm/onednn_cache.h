// What the oneDNN-backed CPU kernels share: the one CPU engine, and a process-wide, thread-safe,
// bounded cache of created primitives keyed by everything they are specialised on, so that
// steady-state training steps create none. When full the cache is emptied (entries in use stay
// alive through their shared_ptr). A creator may return nullptr ("no implementation"); that is
// cached too, so a failed creation is not retried.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>

#include "kuai/backend/cpu/gemm/libraries.h"

namespace kuai::cpu {

inline const dnnl::engine& onednn_engine() {
  static const dnnl::engine engine = [] {
    configure_gemm_libraries();  // oneDNN's max ISA must be set before its first use
    return dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return engine;
}

template <class Key, class Value, class Hash>
class OneDnnCache {
 public:
  template <class Create>
  std::shared_ptr<const Value> get(const Key& key, Create&& create) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = entries_.find(key);
      if (it != entries_.end()) return it->second;
    }
    std::shared_ptr<const Value> made = create(key);  // outside the lock: creation is slow
    std::lock_guard<std::mutex> lock(mutex_);
    if (entries_.size() >= kMaxEntries) entries_.clear();
    return entries_.emplace(key, std::move(made)).first->second;
  }

 private:
  static constexpr size_t kMaxEntries = 512;
  std::mutex mutex_;
  std::unordered_map<Key, std::shared_ptr<const Value>, Hash> entries_;
};

}  // namespace kuai::cpu
