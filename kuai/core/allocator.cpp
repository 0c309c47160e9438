// CPU implementation of the tracking caching allocator: 64-byte aligned blocks, size classes of
// 64 B below 1 MiB and 64 KiB above, an exact-size free list per class, one mutex. No
// transparent-huge-page advice: measured on this VM, first touch of madvised 2 MiB pages ran at
// 0.3 GB/s against 1.2 GB/s for 4 KiB pages (a 4x slower first step) with no steady-state gain.
#include "kuai/core/allocator.h"

#include <cstdlib>
#include <mutex>
#include <new>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace kuai {
namespace {

constexpr size_t kAlign = 64;
constexpr size_t kLargeThreshold = size_t{1} << 20;
constexpr size_t kLargeGranule = size_t{1} << 16;

struct State {
  std::mutex mu;
  MemoryStats stats;
  std::unordered_map<size_t, std::vector<void*>> free_blocks;
};

State& cpu_state() {
  static State* s = new State();  // never destroyed: tensors may outlive static destructors
  return *s;
}

State& state_for(Device d) {
  if (d.type != DeviceType::kCPU)
    throw std::runtime_error("allocator: device " + d.str() + " is not available in this build");
  return cpu_state();
}

}  // namespace

Allocator& Allocator::get() {
  static Allocator a;
  return a;
}

size_t Allocator::round_size(size_t n) {
  if (n == 0) n = 1;
  if (n < kLargeThreshold) return (n + kAlign - 1) / kAlign * kAlign;
  return (n + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
}

void* Allocator::allocate(size_t nbytes, Device device) {
  State& s = state_for(device);
  const size_t size = round_size(nbytes);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stats.num_allocs++;
    s.stats.current += static_cast<int64_t>(size);
    if (s.stats.current > s.stats.peak) s.stats.peak = s.stats.current;
    auto it = s.free_blocks.find(size);
    if (it != s.free_blocks.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      s.stats.cache_hits++;
      return p;
    }
    s.stats.reserved += static_cast<int64_t>(size);
  }
  void* p = std::aligned_alloc(kAlign, size);
  if (p == nullptr) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.stats.current -= static_cast<int64_t>(size);
    s.stats.reserved -= static_cast<int64_t>(size);
    throw std::bad_alloc();
  }
  return p;
}

void Allocator::deallocate(void* ptr, size_t nbytes, Device device) {
  if (ptr == nullptr) return;
  State& s = state_for(device);
  const size_t size = round_size(nbytes);
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.current -= static_cast<int64_t>(size);
  s.free_blocks[size].push_back(ptr);
}

MemoryStats Allocator::stats(Device device) const {
  State& s = state_for(device);
  std::lock_guard<std::mutex> lock(s.mu);
  return s.stats;
}

void Allocator::reset_peak(Device device) {
  State& s = state_for(device);
  std::lock_guard<std::mutex> lock(s.mu);
  s.stats.peak = s.stats.current;
}

void Allocator::empty_cache(Device device) {
  State& s = state_for(device);
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& [size, blocks] : s.free_blocks) {
    for (void* p : blocks) std::free(p);
    s.stats.reserved -= static_cast<int64_t>(size * blocks.size());
  }
  s.free_blocks.clear();
}

}  // namespace kuai
