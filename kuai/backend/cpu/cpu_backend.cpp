// The CPU backend (core/backend.h): 64-byte aligned host memory, memcpy for every copy, the
// serial converter of convert.h, and eval_cpu for primitives. Registered before main. The first
// evaluation checks the ISA tier (isa.h): a bad KUAI_MAX_ISA is then an error on the dispatching
// thread, named, instead of a throw inside a kernel's parallel region.
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>

#include "kuai/backend/cpu/attention_choice.h"
#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/core/backend.h"
#include "kuai/core/primitive.h"

namespace kuai::cpu {
namespace {

class CpuBackend final : public Backend {
 public:
  DeviceType type() const override { return DeviceType::kCPU; }
  std::string describe() const override {
    return "cpu: " + cpu_id().model_name + ", tier " + std::string(isa_name(isa()));
  }
  bool host_accessible() const override { return true; }
  void* allocate(size_t nbytes) override { return std::aligned_alloc(64, nbytes); }
  void deallocate(void* p, size_t) override { std::free(p); }
  void copy_from_host(void* dst, const void* src, size_t n) override {
    if (n > 0) std::memcpy(dst, src, n);
  }
  void copy_to_host(void* dst, const void* src, size_t n) override {
    if (n > 0) std::memcpy(dst, src, n);
  }
  void copy_within(void* dst, const void* src, size_t n) override {
    if (n > 0 && dst != src) std::memmove(dst, src, n);
  }
  void convert(const void* src, DType st, void* dst, DType dt, int64_t n) override {
    convert_serial(src, st, dst, dt, n);
  }
  void evaluate(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override {
    static const bool tier_checked = (isa(), true);  // throws again until KUAI_MAX_ISA is valid
    (void)tier_checked;
    p.eval_cpu(in, out);
  }
  AttentionKernel faster_attention(const AttentionShape& s) override {
    return choose_attention_kernel(s);
  }
};

// Before every ordinary static initializer (a static tensor elsewhere may allocate).
__attribute__((constructor(101))) void register_cpu_backend() {
  static CpuBackend backend;
  register_backend(DeviceType::kCPU, &backend);
}

}  // namespace
}  // namespace kuai::cpu
