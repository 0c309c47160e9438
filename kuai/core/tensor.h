// The tensor handle: cheap to copy (shared ownership of one TensorImpl), over a shape, strides,
// an element offset, a dtype, a device, a storage, and the autograd state (requires_grad, grad,
// the node that produced it, grad-ready hooks on leaves). Views (reshape, transpose, chunk)
// share storage. Ops on tensors are free functions in ops.h; the members here are shortcuts.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/core/device.h"
#include "kuai/core/dtype.h"

namespace kuai {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "(2, 3, 4)"
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& s);

// Bytes owned through the allocator; returned to it when the last tensor lets go.
struct Storage {
  Storage(size_t nbytes, Device device);
  // Memory the storage does not own (kernel scratch): it must outlive every tensor over it.
  Storage(void* borrowed, size_t nbytes, Device device);
  // Memory another library owns (a NumPy array, a DLPack tensor): `owner` keeps it alive and is
  // released with the storage, so the bytes live as long as any tensor over them.
  Storage(void* external, size_t nbytes, Device device, std::shared_ptr<void> owner);
  // Owned bytes that start released (materialize() allocates them): a ZeRO-3 unit's buffer,
  // never allocated before its first gather.
  struct Released {};
  Storage(Released, size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  // ZeRO-3's gathered parameters (distributed/zero3.h): an owned storage's bytes go back to the
  // allocator while every tensor over it stays (release), and come again, uninitialised, when
  // they are needed (materialize), as PyTorch's FSDP resizes a storage to 0 and back. A kernel
  // handed a tensor over released bytes is an error (dispatch checks), never a read of freed
  // memory.
  void release();
  void materialize();
  bool resident() const { return !released; }

  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  bool owned = true;
  bool released = false;
  std::shared_ptr<void> owner;  // external memory's keeper (null otherwise)
};

namespace autograd {
class Node;
}
class Tensor;
using GradHook = std::function<void(const Tensor& grad)>;

struct TensorImpl {
  Shape shape;
  Shape strides;  // in elements
  int64_t offset = 0;
  DType dtype = DType::kF32;
  Device device = kCPU;
  std::shared_ptr<Storage> storage;  // null for a meta tensor (shape and dtype only)
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<autograd::Node> grad_fn;         // null for leaves
  int output_nr = 0;                               // which output of grad_fn this is
  std::weak_ptr<autograd::Node> grad_accumulator;  // leaves: shared by every use in a graph
  std::vector<GradHook> hooks;                     // leaves: fired once its grad is final
  // A low-precision parameter whose fp32 master is kept elsewhere (an optimizer's offloaded
  // masters): its .grad accumulates in fp32, and under autocast only products may read it.
  bool master_elsewhere = false;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialised contiguous tensor from the allocator.
  static Tensor empty(const Shape& shape, DType dtype = DType::kF32, Device device = kCPU);
  // Shape and dtype without storage: what autograd keeps of inputs it does not need to save.
  static Tensor meta(const Shape& shape, DType dtype, Device device = kCPU);
  // A view over another tensor's storage.
  static Tensor view_of(const Tensor& base, Shape shape, Shape strides, int64_t offset);
  // A contiguous tensor of `dtype` at `offset` elements into a storage it shares (a planned
  // buffer in an arena); the range must lie inside the storage.
  // A contiguous tensor over `data`, memory it does not own (see Storage).
  static Tensor borrow(void* data, Shape shape, DType dtype, Device device = kCPU);
  static Tensor in_storage(std::shared_ptr<Storage> storage, Shape shape, DType dtype,
                           int64_t offset);
  // A view over memory another library owns (zero-copy interchange: NumPy, DLPack): `data` is
  // element 0, strides are in elements and must be >= 0; `owner` is kept until the last tensor
  // over the bytes is gone. Throws std::invalid_argument on a negative dimension or stride.
  static Tensor from_external(void* data, Shape shape, Shape strides, DType dtype, Device device,
                              std::shared_ptr<void> owner);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl_->shape; }
  const Shape& strides() const { return impl_->strides; }
  int64_t offset() const { return impl_->offset; }
  int64_t dim() const { return static_cast<int64_t>(impl_->shape.size()); }
  int64_t size(int64_t d) const;    // negative d counts from the end
  int64_t stride(int64_t d) const;  // likewise
  int64_t numel() const { return shape_numel(impl_->shape); }
  int64_t nbytes() const { return numel() * dtype_size(impl_->dtype); }
  DType dtype() const { return impl_->dtype; }
  Device device() const { return impl_->device; }
  bool is_contiguous() const;
  bool has_storage() const { return impl_ && impl_->storage != nullptr; }
  const std::shared_ptr<Storage>& storage() const { return impl_->storage; }

  // Host access to the bytes, for code above the backends: a pointer to element 0 of this view.
  // Throws (naming the device) unless the host can address the tensor's device, and counts a
  // host read when the calling thread is running a training step (host_reads.h: StepScope).
  void* raw_data() const;
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw_data());
  }
  // The same pointer for a backend's kernels, on the tensor's own device: unchecked, uncounted.
  void* device_ptr() const {
    return static_cast<char*>(impl_->storage->data) + impl_->offset * dtype_size(impl_->dtype);
  }
  template <typename T>
  T* device_data() const {
    return static_cast<T*>(device_ptr());
  }

  // ---- autograd ----
  bool requires_grad() const { return impl_->requires_grad; }
  Tensor& requires_grad_(bool on = true);
  bool is_leaf() const { return impl_->grad_fn == nullptr; }
  Tensor grad() const { return Tensor(impl_->grad); }
  void set_grad(const Tensor& g) { impl_->grad = g.impl_; }
  const std::shared_ptr<autograd::Node>& grad_fn() const { return impl_->grad_fn; }
  int output_nr() const { return impl_->output_nr; }
  // Gradient of this (scalar unless grad_output is given) with respect to every leaf that
  // requires grad; accumulates into their .grad.
  void backward(const Tensor& grad_output = Tensor()) const;
  // Fires once per backward, after this leaf's gradient is final and accumulated into .grad.
  void register_hook(GradHook hook);
  // Same data, cut from the graph.
  Tensor detach() const;

  // ---- shortcuts for ops.h ----
  Tensor reshape(const Shape& shape) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor contiguous() const;
  Tensor to(DType dtype) const;
  // This tensor on `device` (itself when it is there already): a contiguous copy through the
  // backends (core/backend.h); outside autograd, like detach().
  Tensor to(Device device) const;
  // Copies src's elements into this tensor (same shape and dtype, this one contiguous), from any
  // device to any device, through the backends: not an op (not recorded by autograd or capture,
  // not counted as a host read). How host code writes values into a tensor that may live on a
  // device: the optimizer's learning rate, a batch into a compiled step's inputs, loaded state.
  const Tensor& copy_(const Tensor& src) const;
  // Writes `nbytes` of host memory over this contiguous tensor's bytes (a host-to-device copy).
  const Tensor& copy_from_host(const void* src, size_t nbytes) const;
  // Reads this tensor's bytes (contiguous) into host memory: a host read (counted in a step).
  void copy_to_host(void* dst, size_t nbytes) const;
  Tensor clone() const;
  float item() const;  // the one element, as float: a host read (host_reads.h)
  // The one element of a tensor of dtype T, exactly: a host read, counted wherever it is made.
  template <typename T>
  T item_as() const {
    T v{};
    read_one(&v, sizeof(T));
    return v;
  }
  // copy_to_host() without the count, for a caller that counts its read itself (one
  // count_host_read() for several tensors read together).
  void copy_to_host_uncounted(void* dst, size_t nbytes) const;
  template <typename T>
  std::vector<T> to_vector() const;  // a contiguous copy of the elements (same dtype)

  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  std::string str() const;  // "Tensor(float32, (2, 3))"

 private:
  void read_one(void* dst, size_t element_size) const;
  std::shared_ptr<TensorImpl> impl_;
};

template <typename T>
std::vector<T> Tensor::to_vector() const {
  if (sizeof(T) != static_cast<size_t>(dtype_size(dtype())))
    throw std::invalid_argument("to_vector: element size differs from " + str());
  std::vector<T> v(static_cast<size_t>(numel()));
  contiguous().copy_to_host(v.data(), v.size() * sizeof(T));
  return v;
}

}  // namespace kuai
