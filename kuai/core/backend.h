// The device seam. Everything core needs from a device goes through one small interface: raw
// memory for the caching allocator (allocate, deallocate), copies between this device and host
// memory and within the device, elementwise dtype conversion of device memory (what a
// communication hook needs around a low-precision collective), synchronisation, a description,
// and the evaluation of a primitive on tensors that live on it. A backend registers itself
// (backend/cpu, backend/meta) and core reaches it only through backend_for(device): core includes
// no backend header, so a second backend (CUDA) plugs in without a change above it.
//
// Tensor bytes are reached from code above the backends through Tensor::data<T>() / raw_data()
// (tensor.h): a checked call that throws for a device the host cannot address and that counts as
// a host read while the calling thread runs a training step (host_reads.h). Backends' kernels
// reach bytes through Tensor::device_data<T>() / device_ptr(), unchecked and uncounted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kuai/core/device.h"
#include "kuai/core/dtype.h"

namespace kuai {

class Primitive;
class Tensor;

// A causal self-attention a model is about to run (queries, keys and values (B, H, T, d); keys and
// values with kv_heads heads), for Backend::faster_attention.
struct AttentionShape {
  int64_t batch = 1, heads = 1, kv_heads = 1, seq = 1, head_dim = 1;
  DType dtype = DType::kF32;
  bool causal = true;
};
enum class AttentionKernel { kNaive, kFlash };
// Without a measurement: flash from this many positions on (where it measured faster on a 2-core
// AVX2 CPU; docs/flash_attention.md), naive below.
inline constexpr int64_t kFlashDefaultMinT = 2048;
AttentionKernel default_attention_kernel(const AttentionShape& s);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual DeviceType type() const = 0;
  // One line: what runs ops on this device ("cpu: <model>, tier avx2, 2 threads").
  virtual std::string describe() const = 0;
  // Whether the host may dereference this device's pointers (the CPU's can).
  virtual bool host_accessible() const = 0;
  // Whether tensors on it hold bytes at all (meta tensors have shapes only).
  virtual bool has_bytes() const { return true; }

  // Raw memory under the caching allocator (core/allocator.h), at least 64-byte aligned; null
  // when the device is out of memory. The meta backend hands out distinct addresses it never
  // maps, so the allocator's accounting runs unchanged on it.
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* p, size_t nbytes) = 0;

  // n bytes: host memory to this device, this device to host memory, within this device.
  virtual void copy_from_host(void* dst, const void* host_src, size_t n) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t n) = 0;
  virtual void copy_within(void* dst, const void* src, size_t n) = 0;
  // n contiguous elements of this device's memory from one dtype to another, on the calling
  // thread (no parallel region is forked): a communication hook's cast around a collective.
  virtual void convert(const void* src, DType src_type, void* dst, DType dst_type, int64_t n) = 0;
  // Returns when every operation issued to the device so far has completed.
  virtual void synchronize() {}

  // Runs `p` on inputs and preallocated outputs that live on this device.
  virtual void evaluate(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) = 0;

  // Which attention kernel runs `s` faster on this device, forward and backward together: what a
  // model with attention = "auto" runs. A backend that can measures both kernels once per shape
  // and keeps the answer (the CPU's tuning cache), so that every later run makes the same choice;
  // the default is default_attention_kernel.
  virtual AttentionKernel faster_attention(const AttentionShape& s) {
    return default_attention_kernel(s);
  }
};

// Called once per device type from the backend's own translation unit, by a constructor function
// that runs before ordinary static initializers (the library is linked whole: CMakeLists.txt). A
// second registration replaces the first.
void register_backend(DeviceType type, Backend* backend);
// The backend of `device`; throws std::runtime_error naming the device when none is registered.
Backend& backend_for(Device device);
bool backend_available(DeviceType type);

}  // namespace kuai
