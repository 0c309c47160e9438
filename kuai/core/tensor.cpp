// Tensor handle: construction, views, shape helpers, and the member shortcuts into ops.h.
#include "kuai/core/tensor.h"

#include <fmt/format.h>

#include <stdexcept>

#include "kuai/core/autograd.h"
#include "kuai/core/backend.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"

namespace kuai {

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  if (s.size() == 1) out += ",";
  return out + ")";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

Storage::Storage(size_t n, Device d) : nbytes(n), device(d) {
  data = Allocator::get().allocate(n, d);
}
Storage::Storage(void* borrowed, size_t n, Device d)
    : data(borrowed), nbytes(n), device(d), owned(false) {}
Storage::Storage(void* external, size_t n, Device d, std::shared_ptr<void> keeper)
    : data(external), nbytes(n), device(d), owned(false), owner(std::move(keeper)) {}
Storage::Storage(Released, size_t n, Device d) : nbytes(n), device(d), released(true) {}
Storage::~Storage() {
  if (owned && !released) Allocator::get().deallocate(data, nbytes, device);
}
void Storage::release() {
  if (!owned) throw std::logic_error("Storage::release: the storage does not own its bytes");
  if (released) return;
  Allocator::get().deallocate(data, nbytes, device);
  data = nullptr;
  released = true;
}
void Storage::materialize() {
  if (!released) return;
  data = Allocator::get().allocate(nbytes, device);
  released = false;
}

Tensor Tensor::borrow(void* data, Shape shape, DType dtype, Device device) {
  const auto bytes = static_cast<size_t>(shape_numel(shape) * dtype_size(dtype));
  return in_storage(std::make_shared<Storage>(data, bytes, device), std::move(shape), dtype, 0);
}

Tensor Tensor::from_external(void* data, Shape shape, Shape strides, DType dtype, Device device,
                             std::shared_ptr<void> owner) {
  if (strides.size() != shape.size())
    throw std::invalid_argument("from_external: " + std::to_string(strides.size()) +
                                " strides for shape " + shape_str(shape));
  int64_t extent = 1;  // elements spanned: 1 + sum (size - 1) * stride
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0 || strides[i] < 0)
      throw std::invalid_argument("from_external: negative size or stride in shape " +
                                  shape_str(shape) + ", strides " + shape_str(strides));
    if (shape[i] == 0) empty = true;
    extent += (shape[i] - 1) * strides[i];
  }
  const auto bytes = static_cast<size_t>((empty ? 0 : extent) * dtype_size(dtype));
  auto storage = std::make_shared<Storage>(data, bytes, device, std::move(owner));
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->dtype = dtype;
  impl->device = device;
  impl->storage = std::move(storage);
  return Tensor(std::move(impl));
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape)
    if (d < 0)
      throw std::invalid_argument("empty: negative dimension in shape " + shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->device = device;
  impl->storage = std::make_shared<Storage>(
      static_cast<size_t>(shape_numel(shape) * dtype_size(dtype)), device);
  return Tensor(std::move(impl));
}

Tensor Tensor::meta(const Shape& shape, DType dtype, Device device) {
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->device = device;
  return Tensor(std::move(impl));
}

Tensor Tensor::view_of(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  impl->device = base.device();
  impl->storage = base.storage();
  return Tensor(std::move(impl));
}

Tensor Tensor::in_storage(std::shared_ptr<Storage> storage, Shape shape, DType dtype,
                          int64_t offset) {
  const int64_t bytes = shape_numel(shape) * dtype_size(dtype);
  if (!storage || offset < 0 ||
      (offset + shape_numel(shape)) * dtype_size(dtype) > static_cast<int64_t>(storage->nbytes))
    throw std::out_of_range(fmt::format("in_storage: {} bytes at element {} of {} do not fit",
                                        bytes, offset, storage ? storage->nbytes : 0));
  auto impl = std::make_shared<TensorImpl>();
  impl->strides = contiguous_strides(shape);
  impl->shape = std::move(shape);
  impl->offset = offset;
  impl->dtype = dtype;
  impl->device = storage->device;
  impl->storage = std::move(storage);
  return Tensor(std::move(impl));
}

int64_t Tensor::size(int64_t d) const {
  const int64_t n = dim();
  if (d < 0) d += n;
  if (d < 0 || d >= n) throw std::out_of_range(fmt::format("size: dim {} of {}", d, str()));
  return impl_->shape[d];
}

int64_t Tensor::stride(int64_t d) const {
  const int64_t n = dim();
  if (d < 0) d += n;
  if (d < 0 || d >= n) throw std::out_of_range(fmt::format("stride: dim {} of {}", d, str()));
  return impl_->strides[d];
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t i = dim() - 1; i >= 0; --i) {
    if (impl_->shape[i] == 1) continue;
    if (impl_->strides[i] != expected) return false;
    expected *= impl_->shape[i];
  }
  return true;
}

namespace {

// The tensor's bytes are there: throws naming it when its storage was released.
void require_resident(const Tensor& t, const char* what) {
  if (t.has_storage() && t.storage()->released)
    throw std::runtime_error(std::string(what) + ": " + t.str() +
                             " is over bytes that were released (a ZeRO-3 parameter is whole "
                             "only while its unit runs forward or backward)");
}

// The host may address the tensor's bytes: throws naming the device otherwise.
void require_host(const Tensor& t, const char* what) {
  if (!t.defined() || !t.has_storage())
    throw std::logic_error(std::string(what) + ": tensor has no storage: " + t.str());
  require_resident(t, what);
  const Device d = t.device();
  if (d.type != DeviceType::kCPU && !backend_for(d).host_accessible())
    throw std::runtime_error(
        fmt::format("{}: {} lives on {}, which the host cannot address; "
                    "copy it with .to(kCPU) first",
                    what, t.str(), d.str()));
}

}  // namespace

void* Tensor::raw_data() const {
  require_host(*this, "data");
  count_step_host_read();
  return device_ptr();
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor out = Tensor::empty(shape(), dtype(), device);
  out.copy_(*this);
  return out;
}

const Tensor& Tensor::copy_(const Tensor& src) const {
  if (src.shape() != shape() || src.dtype() != dtype())
    throw std::invalid_argument(fmt::format("copy_: {} into {}", src.str(), str()));
  if (!is_contiguous())
    throw std::invalid_argument("copy_: the destination must be contiguous, got " + str());
  for (const Tensor* t : {&src, this}) require_resident(*t, "copy_");
  const Tensor c = src.is_contiguous() ? src : kuai::contiguous(src.detach());
  const auto n = static_cast<size_t>(nbytes());
  if (n == 0 || (c.storage() == storage() && c.offset() == offset())) return *this;
  const Device from = c.device(), to = device();
  if (from == to) {
    backend_for(to).copy_within(device_ptr(), c.device_ptr(), n);
  } else if (from.type == DeviceType::kCPU) {
    backend_for(to).copy_from_host(device_ptr(), c.device_ptr(), n);
  } else if (to.type == DeviceType::kCPU) {
    backend_for(from).copy_to_host(device_ptr(), c.device_ptr(), n);
  } else {  // between two devices: through host memory
    Tensor staged = c.to(kCPU);
    backend_for(to).copy_from_host(device_ptr(), staged.device_ptr(), n);
  }
  return *this;
}

const Tensor& Tensor::copy_from_host(const void* src, size_t n) const {
  if (!has_storage() || !is_contiguous() || n != static_cast<size_t>(nbytes()))
    throw std::invalid_argument(
        fmt::format("copy_from_host: {} bytes into {} (contiguous, {} bytes)", n, str(), nbytes()));
  require_resident(*this, "copy_from_host");
  backend_for(device()).copy_from_host(device_ptr(), src, n);
  return *this;
}

void Tensor::read_one(void* dst, size_t element_size) const {
  if (numel() != 1 || static_cast<size_t>(dtype_size(dtype())) != element_size)
    throw std::invalid_argument(
        fmt::format("item_as: one element of {} bytes, got {}", element_size, str()));
  count_host_read();
  copy_to_host_uncounted(dst, element_size);
}

void Tensor::copy_to_host_uncounted(void* dst, size_t n) const {
  if (!has_storage() || !is_contiguous() || n != static_cast<size_t>(nbytes()))
    throw std::invalid_argument(
        fmt::format("copy_to_host: {} (contiguous, {} bytes) into {} bytes", str(), nbytes(), n));
  require_resident(*this, "copy_to_host");
  backend_for(device()).copy_to_host(dst, device_ptr(), n);
}

void Tensor::copy_to_host(void* dst, size_t n) const {
  copy_to_host_uncounted(dst, n);
  count_step_host_read();
}

Tensor& Tensor::requires_grad_(bool on) {
  if (on && !is_floating(dtype()))
    throw std::invalid_argument("requires_grad_: only floating tensors can require grad, got " +
                                str());
  if (!is_leaf()) throw std::invalid_argument("requires_grad_: only on leaf tensors");
  impl_->requires_grad = on;
  return *this;
}

void Tensor::backward(const Tensor& grad_output) const { autograd::backward(*this, grad_output); }

void Tensor::register_hook(GradHook hook) {
  if (!is_leaf() || !requires_grad())
    throw std::invalid_argument("register_hook: only on leaf tensors that require grad");
  impl_->hooks.push_back(std::move(hook));
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = impl_->shape;
  impl->strides = impl_->strides;
  impl->offset = impl_->offset;
  impl->dtype = impl_->dtype;
  impl->device = impl_->device;
  impl->storage = impl_->storage;
  return Tensor(std::move(impl));
}

Tensor Tensor::reshape(const Shape& shape) const { return kuai::reshape(*this, shape); }
Tensor Tensor::transpose(int64_t d0, int64_t d1) const { return kuai::transpose(*this, d0, d1); }
Tensor Tensor::contiguous() const { return is_contiguous() ? *this : kuai::contiguous(*this); }
Tensor Tensor::to(DType dtype) const { return dtype == this->dtype() ? *this : cast(*this, dtype); }
Tensor Tensor::clone() const { return kuai::clone(*this); }

float Tensor::item() const {
  if (numel() != 1) throw std::invalid_argument("item: expected one element, got " + str());
  count_host_read();
  unsigned char bytes[8];
  const Tensor c = contiguous();
  c.copy_to_host_uncounted(bytes, static_cast<size_t>(c.nbytes()));
  return static_cast<float>(load_element(bytes, dtype(), 0));
}

std::string Tensor::str() const {
  if (!impl_) return "Tensor(undefined)";
  return fmt::format("Tensor({}, {})", dtype_name(dtype()), shape_str(shape()));
}

}  // namespace kuai
