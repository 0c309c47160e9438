// Tensors in Python: kuai.Tensor over kuai::Tensor, the dtypes and devices, NumPy and DLPack
// interchange without copies where the layout allows, grad mode, and the ops under PyTorch's
// names. Calls into the engine release the GIL (they may run long, and on several threads).
#include <pybind11/numpy.h>
#include <pybind11/operators.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <string>

#include "bindings.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"

namespace kuai::python {

namespace {

using release = py::call_guard<py::gil_scoped_release>;

// ---- DLPack (the ABI of dlpack.h, v0.6-0.8: what torch.from_dlpack exchanges) ----
struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr int32_t kDLCPU = 1, kDLCUDA = 2;
constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

DLDataType to_dl(DType t) {
  switch (t) {
    case DType::kF32:
      return {2, 32, 1};
    case DType::kBF16:
      return {4, 16, 1};
    case DType::kF16:
      return {2, 16, 1};
    case DType::kI32:
      return {0, 32, 1};
    case DType::kI64:
      return {0, 64, 1};
    case DType::kU8:
      return {1, 8, 1};
  }
  throw std::invalid_argument("DLPack: unknown dtype");
}

DType from_dl(DLDataType t) {
  if (t.lanes != 1)
    throw py::type_error("from_dlpack: vector dtypes (lanes " + std::to_string(t.lanes) +
                         ") are not supported");
  if (t.code == 2 && t.bits == 32) return DType::kF32;
  if (t.code == 2 && t.bits == 16) return DType::kF16;
  if (t.code == 4 && t.bits == 16) return DType::kBF16;
  if (t.code == 0 && t.bits == 32) return DType::kI32;
  if (t.code == 0 && t.bits == 64) return DType::kI64;
  if (t.code == 1 && t.bits == 8) return DType::kU8;
  throw py::type_error(
      "from_dlpack: dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
      " bits) is not one of kuai's float32, bfloat16, float16, int32, int64, uint8");
}

struct ExportContext {
  Tensor tensor;  // keeps the bytes alive until the consumer calls the deleter
  std::vector<int64_t> shape, strides;
  DLManagedTensor managed{};
};

void export_deleter(DLManagedTensor* self) {
  delete static_cast<ExportContext*>(self->manager_ctx);
}

py::capsule to_dlpack(const Tensor& t) {
  if (t.device().type == DeviceType::kMeta)
    throw py::type_error("__dlpack__: a meta tensor has no bytes to share");
  auto* ctx = new ExportContext{t, t.shape(), t.strides(), {}};
  DLTensor& dl = ctx->managed.dl_tensor;
  dl.data = t.numel() > 0 ? t.device_ptr() : nullptr;
  dl.device = {t.device().type == DeviceType::kCUDA ? kDLCUDA : kDLCPU, t.device().index};
  dl.ndim = static_cast<int32_t>(t.dim());
  dl.dtype = to_dl(t.dtype());
  dl.shape = ctx->shape.data();
  dl.strides = ctx->strides.data();
  dl.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = export_deleter;
  // The capsule's destructor frees the tensor only if no consumer took it (a consumer renames
  // the capsule and calls the deleter itself when done).
  return py::capsule(&ctx->managed, kCapsuleName, [](PyObject* cap) {
    if (PyCapsule_IsValid(cap, kCapsuleName)) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kCapsuleName));
      if (m && m->deleter) m->deleter(m);
    }
  });
}

Tensor from_dlpack(const py::object& obj) {
  py::object cap_obj = py::hasattr(obj, "__dlpack__") ? obj.attr("__dlpack__")() : obj;
  PyObject* cap = cap_obj.ptr();
  if (!PyCapsule_IsValid(cap, kCapsuleName))
    throw py::type_error(
        "from_dlpack: expected an object with __dlpack__ or an unconsumed DLPack capsule");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kCapsuleName));
  const DLTensor& dl = m->dl_tensor;
  // The capsule is consumed from here on: its destructor leaves the tensor to our owner.
  PyCapsule_SetName(cap, kUsedCapsuleName);
  std::shared_ptr<void> owner(m, [](void* p) {
    auto* mt = static_cast<DLManagedTensor*>(p);
    if (mt->deleter) mt->deleter(mt);
  });
  if (dl.device.device_type != kDLCPU)
    throw py::type_error("from_dlpack: device type " + std::to_string(dl.device.device_type) +
                         " is not the CPU (kuai's CUDA backend is not built)");
  const DType dtype = from_dl(dl.dtype);
  Shape shape(dl.shape, dl.shape + dl.ndim);
  Shape strides = dl.strides ? Shape(dl.strides, dl.strides + dl.ndim) : contiguous_strides(shape);
  void* data = static_cast<char*>(dl.data) + dl.byte_offset;
  return Tensor::from_external(data, std::move(shape), std::move(strides), dtype, kCPU,
                               std::move(owner));
}

// ---- NumPy ----
std::optional<DType> dtype_of_numpy(const py::dtype& d) {
  const char kind = d.kind();
  const auto size = d.itemsize();
  if (kind == 'f' && size == 4) return DType::kF32;
  if (kind == 'f' && size == 2) return DType::kF16;
  if (kind == 'i' && size == 4) return DType::kI32;
  if (kind == 'i' && size == 8) return DType::kI64;
  if (kind == 'u' && size == 1) return DType::kU8;
  if (kind == 'b' && size == 1) return DType::kU8;  // bool as uint8 (0 / 1)
  return std::nullopt;
}

py::dtype numpy_dtype(DType t) {
  switch (t) {
    case DType::kF32:
      return py::dtype("float32");
    case DType::kF16:
      return py::dtype("float16");
    case DType::kI32:
      return py::dtype("int32");
    case DType::kI64:
      return py::dtype("int64");
    case DType::kU8:
      return py::dtype("uint8");
    case DType::kBF16:
      break;
  }
  throw py::type_error(
      "numpy() : NumPy has no bfloat16; convert first (t.float().numpy()), as with torch");
}

// Zero-copy: the tensor views the array's bytes and keeps the array alive.
Tensor from_numpy(const py::array& arr) {
  const auto dt = dtype_of_numpy(arr.dtype());
  if (!dt)
    throw py::type_error("from_numpy: NumPy dtype " + std::string(py::str(arr.dtype())) +
                         " is not one of float32, float16, int32, int64, uint8, bool (kuai has "
                         "no float64: use arr.astype(np.float32))");
  const auto itemsize = arr.itemsize();
  Shape shape(arr.shape(), arr.shape() + arr.ndim()), strides(static_cast<size_t>(arr.ndim()));
  for (py::ssize_t i = 0; i < arr.ndim(); ++i) {
    const auto s = arr.strides()[i];
    if (s < 0 || s % itemsize != 0)
      throw py::value_error(
          "from_numpy: the array has negative or unaligned strides; pass a copy "
          "(np.ascontiguousarray(arr))");
    strides[static_cast<size_t>(i)] = s / itemsize;
  }
  auto* keep = new py::object(arr);
  std::shared_ptr<void> owner(keep, [](void* p) {
    if (!Py_IsInitialized()) return;  // interpreter gone: nothing left to release
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
  return Tensor::from_external(const_cast<void*>(arr.data()), std::move(shape), std::move(strides),
                               *dt, kCPU, std::move(owner));
}

// A NumPy array over the tensor's bytes (a host access, counted in a step), keeping it alive.
py::array to_numpy(const Tensor& t) {
  const py::dtype dt = numpy_dtype(t.dtype());
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end()), strides;
  for (int64_t s : t.strides())
    strides.push_back(static_cast<py::ssize_t>(s * dtype_size(t.dtype())));
  void* data = t.numel() > 0 ? t.raw_data() : nullptr;
  py::capsule base(new Tensor(t), [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(dt, shape, strides, data, base);
}

// A new tensor of the array's values (a copy into the tracking allocator), in `dtype` if given.
Tensor tensor_from_array(py::array arr, std::optional<DType> dtype) {
  if (arr.dtype().kind() == 'f' && arr.itemsize() == 8)  // Python floats: float32, as torch
    arr = py::array::ensure(arr.attr("astype")("float32"));
  if (arr.dtype().kind() == 'O')
    throw py::type_error("tensor: the data is not numeric (or its rows are ragged)");
  const Tensor view = from_numpy(py::array::ensure(arr, py::array::c_style | py::array::forcecast));
  Tensor out = Tensor::empty(view.shape(), view.dtype(), kCPU);
  {
    py::gil_scoped_release nogil;
    out.copy_(view);
    if (dtype && *dtype != out.dtype()) {
      autograd::NoGradGuard no_grad;
      out = cast(out, *dtype);
    }
  }
  return out;
}

DType dtype_or(const py::object& o, DType dflt) { return o.is_none() ? dflt : o.cast<DType>(); }

Device device_of(const py::object& o) {
  if (o.is_none()) return default_device();
  if (py::isinstance<Device>(o)) return o.cast<Device>();
  const auto s = o.cast<std::string>();
  if (s == "cpu") return kCPU;
  if (s == "meta") return kMeta;
  throw py::value_error("device: '" + s + "' is not one of 'cpu', 'meta'");
}

// A scalar operand as a () tensor of `like`'s dtype (floating) or float32.
Tensor scalar_like(const Tensor& like, double v) {
  const DType dt = is_floating(like.dtype()) ? like.dtype() : DType::kF32;
  autograd::NoGradGuard no_grad;
  return full({}, static_cast<float>(v), dt, like.device());
}

int64_t wrap_dim(int64_t d, int64_t n) { return d < 0 ? d + n : d; }

std::string tensor_repr(const Tensor& t) {
  std::string head = "tensor(";
  if (!t.defined()) return "tensor(undefined)";
  std::string body;
  if (t.device().type == DeviceType::kCPU && t.dtype() != DType::kBF16) {
    body = py::str(to_numpy(t));
  } else if (t.device().type == DeviceType::kCPU) {
    autograd::NoGradGuard no_grad;
    body = py::str(to_numpy(cast(t, DType::kF32)));
  } else {
    body = "...";
  }
  std::string extra = ", dtype=kuai." + std::string(dtype_name(t.dtype()));
  if (t.device() != kCPU) extra += ", device='" + t.device().str() + "'";
  if (t.requires_grad()) extra += ", requires_grad=True";
  return head + body + extra + ")";
}

// Basic indexing: ints and slices with step 1 (views, through narrow and reshape).
Tensor index(const Tensor& t, const py::object& key) {
  py::tuple keys = py::isinstance<py::tuple>(key) ? key.cast<py::tuple>() : py::make_tuple(key);
  Tensor out = t;
  int64_t dim = 0;
  std::vector<int64_t> drop;  // dims indexed by an int, removed at the end
  for (const py::handle k : keys) {
    if (dim >= t.dim())
      throw py::index_error("too many indices for tensor of dimension " + std::to_string(t.dim()));
    const int64_t n = out.size(dim);
    if (py::isinstance<py::int_>(k)) {
      int64_t i = k.cast<int64_t>();
      if (i < -n || i >= n)
        throw py::index_error("index " + std::to_string(i) + " is out of bounds for dimension " +
                              std::to_string(dim) + " with size " + std::to_string(n));
      out = narrow(out, dim, i < 0 ? i + n : i, 1);
      drop.push_back(dim);
    } else if (py::isinstance<py::slice>(k)) {
      py::ssize_t start, stop, step, len;
      if (!k.cast<py::slice>().compute(static_cast<py::ssize_t>(n), &start, &stop, &step, &len))
        throw py::error_already_set();
      if (step != 1) throw py::index_error("slices with a step other than 1 are not supported");
      out = narrow(out, dim, start, len);
    } else if (k.is_none()) {
      throw py::index_error("None (new axis) indexing is not supported; use reshape");
    } else {
      throw py::index_error("only integers and slices index a kuai tensor");
    }
    ++dim;
  }
  if (!drop.empty()) {
    Shape s;
    for (int64_t d = 0; d < out.dim(); ++d)
      if (std::find(drop.begin(), drop.end(), d) == drop.end()) s.push_back(out.size(d));
    out = reshape(out, s);
  }
  return out;
}

Tensor sum_dims(const Tensor& x, const py::object& dim, bool keepdim) {
  if (dim.is_none()) return keepdim ? reshape(sum(x), Shape(x.dim(), 1)) : sum(x);
  return sum(x, dim.cast<int64_t>(), keepdim);
}
Tensor mean_dims(const Tensor& x, const py::object& dim, bool keepdim) {
  if (dim.is_none()) return keepdim ? reshape(mean(x), Shape(x.dim(), 1)) : mean(x);
  return mean(x, dim.cast<int64_t>(), keepdim);
}

Tensor softmax_dim(const Tensor& x, int64_t dim) {
  if (wrap_dim(dim, x.dim()) != x.dim() - 1)
    throw py::value_error(
        "softmax: kuai's softmax runs over the last dimension (dim=-1); got dim=" +
        std::to_string(dim));
  return softmax(x);
}

Generator g_default_generator(0, 0);

}  // namespace

Generator& default_generator() { return g_default_generator; }
Generator& generator_or_default(const py::object& gen) {
  return gen.is_none() ? g_default_generator : gen.cast<Generator&>();
}

Shape to_shape(const py::handle& obj) {
  if (py::isinstance<py::int_>(obj)) return {obj.cast<int64_t>()};
  Shape s;
  for (const py::handle h : obj) s.push_back(h.cast<int64_t>());
  return s;
}
Shape shape_from_args(const py::args& args) {
  if (args.size() == 1 && !py::isinstance<py::int_>(args[0])) return to_shape(args[0]);
  Shape s;
  for (const py::handle h : args) s.push_back(h.cast<int64_t>());
  return s;
}
py::tuple shape_tuple(const Shape& s) {
  py::tuple t(s.size());
  for (size_t i = 0; i < s.size(); ++i) t[i] = s[i];
  return t;
}

void bind_tensor(py::module_& m) {
  py::enum_<DType>(m, "dtype")
      .value("float32", DType::kF32)
      .value("bfloat16", DType::kBF16)
      .value("float16", DType::kF16)
      .value("int32", DType::kI32)
      .value("int64", DType::kI64)
      .value("uint8", DType::kU8)
      .def("__repr__", [](DType t) { return "kuai." + std::string(dtype_name(t)); })
      .def("__str__", [](DType t) { return "kuai." + std::string(dtype_name(t)); })
      .def_property_readonly("itemsize", [](DType t) { return dtype_size(t); })
      .def_property_readonly("is_floating_point", [](DType t) { return is_floating(t); });
  for (auto [name, t] : {std::pair{"float32", DType::kF32},
                         {"float", DType::kF32},
                         {"bfloat16", DType::kBF16},
                         {"float16", DType::kF16},
                         {"half", DType::kF16},
                         {"int32", DType::kI32},
                         {"int", DType::kI32},
                         {"int64", DType::kI64},
                         {"long", DType::kI64},
                         {"uint8", DType::kU8}})
    m.attr(name) = t;

  py::class_<Device>(m, "device")
      .def(py::init([](const py::object& o) { return device_of(o); }))
      .def_property_readonly("type",
                             [](const Device& d) {
                               return d.type == DeviceType::kCUDA ? std::string("cuda") : d.str();
                             })
      .def_readonly("index", &Device::index)
      .def("__str__", &Device::str)
      .def("__repr__", [](const Device& d) { return "device(type='" + d.str() + "')"; })
      .def("__eq__",
           [](const Device& d, const py::object& o) {
             return (py::isinstance<Device>(o) && o.cast<Device>() == d) ||
                    (py::isinstance<py::str>(o) && o.cast<std::string>() == d.str());
           })
      .def("__hash__", [](const Device& d) { return std::hash<std::string>()(d.str()); });

  py::class_<Generator>(m, "Generator")
      .def(py::init<uint64_t, uint64_t>(), py::arg("seed") = 0, py::arg("stream") = 0)
      .def("initial_seed", &Generator::seed)
      .def_property("offset", &Generator::offset, &Generator::set_offset);
  m.def(
      "manual_seed",
      [](uint64_t seed) {
        g_default_generator = Generator(seed, 0);
        return &g_default_generator;
      },
      py::arg("seed"), py::return_value_policy::reference);
  m.def("default_generator", &default_generator, py::return_value_policy::reference);

  py::class_<Tensor> t(m, "Tensor", py::dynamic_attr());
  t.def_property_readonly("shape", [](const Tensor& x) { return shape_tuple(x.shape()); })
      .def(
          "size",
          [](const Tensor& x, const py::object& dim) -> py::object {
            if (dim.is_none()) return shape_tuple(x.shape());
            return py::int_(x.size(dim.cast<int64_t>()));
          },
          py::arg("dim") = py::none())
      .def(
          "stride",
          [](const Tensor& x, const py::object& dim) -> py::object {
            if (dim.is_none()) return shape_tuple(x.strides());
            return py::int_(x.stride(dim.cast<int64_t>()));
          },
          py::arg("dim") = py::none())
      .def("storage_offset", &Tensor::offset)
      .def("dim", &Tensor::dim)
      .def_property_readonly("ndim", &Tensor::dim)
      .def("numel", &Tensor::numel)
      .def("__len__",
           [](const Tensor& x) {
             if (x.dim() == 0) throw py::type_error("len() of a 0-d tensor");
             return x.size(0);
           })
      .def("element_size", [](const Tensor& x) { return dtype_size(x.dtype()); })
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def("is_contiguous", &Tensor::is_contiguous)
      .def("data_ptr", [](const Tensor& x) { return reinterpret_cast<uintptr_t>(x.device_ptr()); })
      // autograd
      .def_property("requires_grad", &Tensor::requires_grad,
                    [](Tensor& x, bool on) { x.requires_grad_(on); })
      .def(
          "requires_grad_", [](Tensor& x, bool on) { return x.requires_grad_(on); },
          py::arg("requires_grad") = true)
      .def_property_readonly("is_leaf", &Tensor::is_leaf)
      .def_property(
          "grad",
          [](const Tensor& x) -> py::object {
            Tensor g = x.grad();
            return g.defined() ? py::cast(g) : py::none();
          },
          [](Tensor& x, const py::object& g) {
            x.set_grad(g.is_none() ? Tensor() : g.cast<Tensor>());
          })
      .def(
          "backward",
          [](const Tensor& x, const py::object& gradient) {
            const Tensor g = gradient.is_none() ? Tensor() : gradient.cast<Tensor>();
            py::gil_scoped_release nogil;
            x.backward(g);
          },
          py::arg("gradient") = py::none())
      .def("register_hook",
           [](Tensor& x, py::function fn) {
             x.register_hook([fn](const Tensor& g) {
               py::gil_scoped_acquire gil;
               fn(g);
             });
           })
      .def("detach", &Tensor::detach)
      // host values
      .def("item",
           [](const Tensor& x) -> py::object {
             if (x.numel() != 1)
               throw py::value_error("item(): a tensor with " + std::to_string(x.numel()) +
                                     " elements cannot be converted to a Python scalar");
             if (is_floating(x.dtype())) return py::float_(x.item());
             return py::int_(static_cast<int64_t>(x.item()));
           })
      .def("__float__", [](const py::object& self) { return py::float_(self.attr("item")()); })
      .def("__int__", [](const py::object& self) { return py::int_(self.attr("item")()); })
      .def("__bool__",
           [](const py::object& self) {
             const py::object v = self.attr("item")();
             return py::cast<bool>(v.attr("__bool__")());
           })
      .def("numpy", &to_numpy)
      .def("tolist", [](const Tensor& x) { return to_numpy(x.contiguous()).attr("tolist")(); })
      .def("__array__", [](const Tensor& x) { return to_numpy(x); })
      .def(
          "__dlpack__", [](const Tensor& x, const py::object& stream) { return to_dlpack(x); },
          py::arg("stream") = py::none())
      .def("__dlpack_device__",
           [](const Tensor& x) {
             return py::make_tuple(x.device().type == DeviceType::kCUDA ? kDLCUDA : kDLCPU,
                                   x.device().index);
           })
      .def("__repr__", &tensor_repr)
      // copies, casts, views
      .def(
          "contiguous", [](const Tensor& x) { return x.is_contiguous() ? x : contiguous(x); },
          release())
      .def("clone", &Tensor::clone, release())
      .def(
          "to",
          [](const Tensor& x, const py::object& target) {
            if (py::isinstance<DType>(target)) return x.to(target.cast<DType>());
            return x.to(device_of(target));
          },
          py::arg("target"))
      .def(
          "float", [](const Tensor& x) { return x.to(DType::kF32); }, release())
      .def(
          "bfloat16", [](const Tensor& x) { return x.to(DType::kBF16); }, release())
      .def(
          "half", [](const Tensor& x) { return x.to(DType::kF16); }, release())
      .def(
          "int", [](const Tensor& x) { return x.to(DType::kI32); }, release())
      .def(
          "long", [](const Tensor& x) { return x.to(DType::kI64); }, release())
      .def(
          "copy_", [](const Tensor& x, const Tensor& src) { return x.copy_(src); }, release())
      .def("reshape", [](const Tensor& x, py::args s) { return reshape(x, shape_from_args(s)); })
      .def("view", [](const Tensor& x, py::args s) { return reshape(x, shape_from_args(s)); })
      .def("transpose", [](const Tensor& x, int64_t a, int64_t b) { return transpose(x, a, b); })
      .def("t", [](const Tensor& x) { return transpose(x, 0, 1); })
      .def_property_readonly("T",
                             [](const Tensor& x) {
                               std::vector<int64_t> d;
                               for (int64_t i = x.dim() - 1; i >= 0; --i) d.push_back(i);
                               return permute(x, d);
                             })
      .def("permute",
           [](const Tensor& x, py::args dims) { return permute(x, shape_from_args(dims)); })
      .def("narrow", &narrow)
      .def("expand", [](const Tensor& x, py::args s) { return expand(x, shape_from_args(s)); })
      .def(
          "chunk", [](const Tensor& x, int64_t n, int64_t dim) { return chunk(x, n, dim); },
          py::arg("chunks"), py::arg("dim") = 0)
      .def(
          "split",
          [](const Tensor& x, const py::object& sizes, int64_t dim) {
            if (py::isinstance<py::int_>(sizes)) {
              const int64_t each = sizes.cast<int64_t>(), n = x.size(dim);
              std::vector<int64_t> parts;
              for (int64_t at = 0; at < n; at += each) parts.push_back(std::min(each, n - at));
              return split(x, parts, dim);
            }
            return split(x, to_shape(sizes), dim);
          },
          py::arg("split_size_or_sections"), py::arg("dim") = 0)
      .def("__getitem__", &index)
      // reductions and functions
      .def("sum", &sum_dims, py::arg("dim") = py::none(), py::arg("keepdim") = false, release())
      .def("mean", &mean_dims, py::arg("dim") = py::none(), py::arg("keepdim") = false, release())
      .def("softmax", &softmax_dim, py::arg("dim"), release())
      .def("matmul", &matmul, release())
      // operators
      .def("__matmul__", &matmul, release())
      .def(
          "__add__", [](const Tensor& a, const Tensor& b) { return add(a, b); }, release())
      .def("__add__", [](const Tensor& a, double s) { return add(a, scalar_like(a, s)); })
      .def("__radd__", [](const Tensor& a, double s) { return add(scalar_like(a, s), a); })
      .def(
          "__sub__", [](const Tensor& a, const Tensor& b) { return sub(a, b); }, release())
      .def("__sub__", [](const Tensor& a, double s) { return sub(a, scalar_like(a, s)); })
      .def("__rsub__", [](const Tensor& a, double s) { return sub(scalar_like(a, s), a); })
      .def(
          "__mul__", [](const Tensor& a, const Tensor& b) { return mul(a, b); }, release())
      .def("__mul__", [](const Tensor& a, double s) { return scale(a, static_cast<float>(s)); })
      .def("__rmul__", [](const Tensor& a, double s) { return scale(a, static_cast<float>(s)); })
      .def(
          "__truediv__", [](const Tensor& a, const Tensor& b) { return div(a, b); }, release())
      .def("__truediv__",
           [](const Tensor& a, double s) { return scale(a, static_cast<float>(1.0 / s)); })
      .def("__rtruediv__", [](const Tensor& a, double s) { return div(scalar_like(a, s), a); })
      .def("__neg__", [](const Tensor& a) { return scale(a, -1.0f); })
      .def("__iadd__", [](const Tensor& a, const Tensor& b) {
        if (a.requires_grad() && autograd::GradMode::enabled())
          throw py::value_error(
              "a leaf tensor that requires grad is used in an in-place operation (use "
              "kuai.no_grad())");
        add_(a, b);
        return a;
      });

  // ---- creation ----
  m.def("from_numpy", &from_numpy, py::arg("ndarray"));
  m.def("from_dlpack", &from_dlpack, py::arg("ext_tensor"));
  m.def("to_dlpack", &to_dlpack, py::arg("tensor"));
  m.def(
      "tensor",
      [](const py::object& data, const py::object& dtype, bool requires_grad) {
        Tensor out;
        if (py::isinstance<Tensor>(data)) {
          py::gil_scoped_release nogil;
          autograd::NoGradGuard no_grad;
          out = clone(data.cast<Tensor>().detach());
          if (!dtype.is_none()) out = out.to(dtype.cast<DType>());
        } else {
          out = tensor_from_array(
              py::array(py::module_::import("numpy").attr("asarray")(data)),
              dtype.is_none() ? std::nullopt : std::optional(dtype.cast<DType>()));
        }
        if (requires_grad) out.requires_grad_(true);
        return out;
      },
      py::arg("data"), py::kw_only(), py::arg("dtype") = py::none(),
      py::arg("requires_grad") = false);
  m.def(
      "zeros",
      [](py::args shape, const py::object& dtype, const py::object& device, bool rg) {
        Tensor z = zeros(shape_from_args(shape), dtype_or(dtype, DType::kF32), device_of(device));
        return rg ? z.requires_grad_(true) : z;
      },
      py::kw_only(), py::arg("dtype") = py::none(), py::arg("device") = py::none(),
      py::arg("requires_grad") = false);
  m.def(
      "ones",
      [](py::args shape, const py::object& dtype, const py::object& device, bool rg) {
        Tensor z =
            full(shape_from_args(shape), 1.0f, dtype_or(dtype, DType::kF32), device_of(device));
        return rg ? z.requires_grad_(true) : z;
      },
      py::kw_only(), py::arg("dtype") = py::none(), py::arg("device") = py::none(),
      py::arg("requires_grad") = false);
  m.def(
      "full",
      [](const py::object& shape, double value, const py::object& dtype, const py::object& device) {
        return full(to_shape(shape), static_cast<float>(value), dtype_or(dtype, DType::kF32),
                    device_of(device));
      },
      py::arg("size"), py::arg("fill_value"), py::kw_only(), py::arg("dtype") = py::none(),
      py::arg("device") = py::none());
  m.def(
      "empty",
      [](py::args shape, const py::object& dtype, const py::object& device) {
        return Tensor::empty(shape_from_args(shape), dtype_or(dtype, DType::kF32),
                             device_of(device));
      },
      py::kw_only(), py::arg("dtype") = py::none(), py::arg("device") = py::none());
  m.def("zeros_like", [](const Tensor& x) { return zeros(x.shape(), x.dtype(), x.device()); });
  m.def("ones_like", [](const Tensor& x) { return full(x.shape(), 1.0f, x.dtype(), x.device()); });
  m.def(
      "arange",
      [](int64_t n, const py::object& dtype, const py::object& device) {
        return arange(n, dtype_or(dtype, DType::kI32), device_of(device));
      },
      py::arg("end"), py::kw_only(), py::arg("dtype") = py::none(), py::arg("device") = py::none());
  m.def(
      "randn",
      [](py::args shape, const py::object& gen, bool rg) {
        Tensor r = generator_or_default(gen).normal(shape_from_args(shape));
        return rg ? r.requires_grad_(true) : r;
      },
      py::kw_only(), py::arg("generator") = py::none(), py::arg("requires_grad") = false);
  m.def(
      "rand",
      [](py::args shape, const py::object& gen) {
        return generator_or_default(gen).uniform(shape_from_args(shape));
      },
      py::kw_only(), py::arg("generator") = py::none());
  m.def(
      "randint",
      [](int32_t low, int32_t high, const py::object& size, const py::object& gen) {
        return generator_or_default(gen).randint(to_shape(size), low, high);
      },
      py::arg("low"), py::arg("high"), py::arg("size"), py::kw_only(),
      py::arg("generator") = py::none());

  // ---- grad mode ----
  m.def("is_grad_enabled", &autograd::GradMode::enabled);
  m.def("set_grad_enabled", &autograd::GradMode::set_enabled, py::arg("mode"));

  // ---- ops (PyTorch's names; kuai/core/ops.h) ----
  m.def("add", &add, release());
  m.def("sub", &sub, release());
  m.def("mul", &mul, release());
  m.def("div", &div, release());
  m.def("matmul", &matmul, release());
  m.def("sum", &sum_dims, py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false,
        release());
  m.def("mean", &mean_dims, py::arg("input"), py::arg("dim") = py::none(),
        py::arg("keepdim") = false, release());
  m.def("reshape", [](const Tensor& x, const py::object& s) { return reshape(x, to_shape(s)); });
  m.def("transpose", &transpose, py::arg("input"), py::arg("dim0"), py::arg("dim1"));
  m.def("permute", [](const Tensor& x, const py::object& d) { return permute(x, to_shape(d)); });
  m.def("narrow", &narrow);
  m.def(
      "cat", [](const std::vector<Tensor>& xs, int64_t dim) { return cat(xs, dim); },
      py::arg("tensors"), py::arg("dim") = 0, release());
  m.def("softmax", &softmax_dim, py::arg("input"), py::arg("dim"), release());
  m.def("gelu", &gelu, release());
  m.def("silu", &silu, release());
  m.def("swiglu", &swiglu, release());
  m.def(
      "rope",
      [](const Tensor& x, double theta, int64_t rotated_heads, int64_t pos0) {
        return rope(x, theta, rotated_heads, pos0);
      },
      py::arg("input"), py::arg("theta") = 10000.0, py::arg("rotated_heads") = -1,
      py::arg("pos0") = 0, release());
  m.def(
      "linear",
      [](const Tensor& x, const Tensor& w, const std::optional<Tensor>& b) {
        return linear(x, w, b.value_or(Tensor()));
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), release());
  m.def(
      "layer_norm",
      [](const Tensor& x, const Tensor& w, const Tensor& b, float eps) {
        return layer_norm(x, w, b, eps);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias"), py::arg("eps") = 1e-5f, release());
  m.def(
      "rms_norm", [](const Tensor& x, const Tensor& w, float eps) { return rms_norm(x, w, eps); },
      py::arg("input"), py::arg("weight"), py::arg("eps") = 1e-5f, release());
  m.def(
      "embedding", [](const Tensor& idx, const Tensor& w) { return embedding(w, idx); },
      py::arg("input"), py::arg("weight"), release());
  m.def(
      "cross_entropy",
      [](const Tensor& logits, const Tensor& targets, int32_t ignore_index) {
        return cross_entropy(logits, targets, ignore_index);
      },
      py::arg("input"), py::arg("target"), py::arg("ignore_index") = -100, release());
  m.def(
      "scaled_dot_product_attention",
      [](const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
        return scaled_dot_product_attention(q, k, v, causal);
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::kw_only(),
      py::arg("is_causal") = false, release());
  m.def(
      "flash_attention",
      [](const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
        return flash_attention(q, k, v, causal);
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::kw_only(),
      py::arg("is_causal") = false, release());
}

}  // namespace kuai::python
