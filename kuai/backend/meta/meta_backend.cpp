// The meta backend (core/backend.h): tensors with shapes, dtypes and strides and no bytes. Its
// allocator hands out distinct, never-mapped, 64-byte aligned addresses, so the caching allocator
// above it (core/allocator.h) keeps its exact accounting: sizes rounded, freed blocks cached and
// reused as on the CPU. A step run on meta tensors therefore allocates what the same step on the
// CPU allocates, in the same order, and the allocator's peak for Device kMeta is that step's peak
// of live tensors. Evaluating a primitive does nothing: the outputs' shapes and dtypes are the
// primitive's infer(), decided at dispatch. What evaluating does is take, and give back, the
// scratch the CPU kernel would take (Primitive::cpu_scratch, the kernel's own formula; from the
// region a compiled step lends, as the kernel would), so the allocator's meta peak is the CPU
// step's; and run the host logic of a collective's launch and
// wait (Primitive::host_side), which talks to its process group (a meta group records it).
// Copies into meta memory do nothing; reading it on the host is an error.
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/core/backend.h"
#include "kuai/core/primitive.h"

namespace kuai::meta {
namespace {

class MetaBackend final : public Backend {
 public:
  DeviceType type() const override { return DeviceType::kMeta; }
  std::string describe() const override { return "meta: shapes and dtypes, no bytes"; }
  bool host_accessible() const override { return false; }
  bool has_bytes() const override { return false; }
  void* allocate(size_t nbytes) override {
    const uint64_t size = (static_cast<uint64_t>(nbytes) + 63) / 64 * 64 + 64;
    return reinterpret_cast<void*>(next_.fetch_add(size, std::memory_order_relaxed));
  }
  void deallocate(void*, size_t) override {}
  void copy_from_host(void*, const void*, size_t) override {}
  void copy_to_host(void*, const void*, size_t) override {
    throw std::runtime_error("a meta tensor has no bytes to copy to the host");
  }
  void copy_within(void*, const void*, size_t) override {}
  void convert(const void*, DType, void*, DType, int64_t) override {}
  void evaluate(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override {
    if (p.host_side()) return p.eval_cpu(in, out);
    const std::vector<int64_t> scratch =
        p.cpu_scratch(in, std::span<const Tensor>(out.data(), out.size()));
    // Held together, as the kernel holds them, from a lent region when one is (a compiled step's
    // planned scratch), else from the allocator.
    std::vector<std::unique_ptr<ScratchBytes>> held;
    for (int64_t bytes : scratch)
      if (bytes > 0)
        held.push_back(std::make_unique<ScratchBytes>(static_cast<size_t>(bytes), kMeta));
  }
  // A step on meta tensors stands for the step on this machine's CPU (its scratch is the CPU
  // kernels'): attention = "auto" takes the kernel the CPU takes.
  AttentionKernel faster_attention(const AttentionShape& s) override {
    return backend_available(DeviceType::kCPU) ? backend_for(kCPU).faster_attention(s)
                                               : default_attention_kernel(s);
  }

 private:
  std::atomic<uint64_t> next_{uint64_t{1} << 44};  // far from any host mapping; never mapped
};

// Before every ordinary static initializer (a static tensor elsewhere may allocate).
__attribute__((constructor(101))) void register_meta_backend() {
  static MetaBackend backend;
  register_backend(DeviceType::kMeta, &backend);
}

}  // namespace
}  // namespace kuai::meta
