// Mixed precision in Python: kuai.amp.autocast (kuai::amp::AutocastGuard held by a context
// manager) and GradScaler (kuai::amp::GradScaler with PyTorch's calls: scale, unscale_, step,
// update). The scaler keeps the step's found_inf flag between unscale_, step and update as
// PyTorch's does; the flag, the scale and the growth tracker stay on the device, so a loop that
// calls scale/step/update reads nothing on the host.
#include <pybind11/stl.h>

#include <memory>
#include <optional>

#include "bindings.h"
#include "kuai/amp/autocast.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/optim/optimizer.h"

namespace kuai::python {

namespace {

// An autocast scope: the guard lives from __enter__ to __exit__ (scopes nest, innermost first).
struct PyAutocast {
  PyAutocast(bool e, DType d) : enabled(e), dtype(d) {}
  PyAutocast(const PyAutocast&) = delete;
  PyAutocast& operator=(const PyAutocast&) = delete;
  bool enabled = true;
  DType dtype = DType::kBF16;
  std::vector<std::unique_ptr<amp::AutocastGuard>> active{};  // a scope re-entered nests
};

DType autocast_dtype_of(const py::object& d) {
  if (py::isinstance<py::str>(d)) {
    const DType t = amp::precision_dtype(d.cast<std::string>());
    if (t == DType::kF32)
      throw py::value_error(
          "autocast: dtype must be \"bf16\" or \"fp16\" (\"fp32\" is autocast off)");
    return t;
  }
  const DType t = d.cast<DType>();
  if (t != DType::kBF16 && t != DType::kF16)
    throw py::value_error("autocast: dtype must be kuai.bfloat16 or kuai.float16");
  return t;
}

}  // namespace

std::vector<Tensor> optimizer_params(const optim::Optimizer& opt) {
  std::vector<Tensor> out;
  for (const auto& g : opt.groups()) out.insert(out.end(), g.params.begin(), g.params.end());
  return out;
}

void PyGradScaler::unscale(optim::Optimizer& opt) {
  if (found_inf)
    throw std::runtime_error(
        "GradScaler.unscale_() has already been called on this optimizer since the last "
        "update()");
  found_inf = scaler.unscale_(optimizer_params(opt));
}

void bind_amp(py::module_& top) {
  py::module_ m = top.def_submodule("amp", "kuai::amp: autocast and the dynamic loss scaler");

  py::class_<PyAutocast>(m, "autocast")
      .def(py::init([](const py::object& dtype, bool enabled) {
             return new PyAutocast(enabled, autocast_dtype_of(dtype));
           }),
           py::arg("dtype") = "bf16", py::arg("enabled") = true,
           "Ops in this scope run in the low dtype where kuai's policy says so (matmul, linear, "
           "attention), in fp32 where precision needs it (LayerNorm, softmax, reductions), and as "
           "they are otherwise; parameters are cast once per scope. Backward runs outside it.")
      .def("__enter__",
           [](PyAutocast& a) -> PyAutocast& {
             a.active.push_back(std::make_unique<amp::AutocastGuard>(a.enabled, a.dtype));
             return a;
           })
      .def("__exit__",
           [](PyAutocast& a, const py::args&) {
             if (!a.active.empty()) a.active.pop_back();
             return false;
           })
      .def_readonly("enabled", &PyAutocast::enabled)
      .def_property_readonly("dtype", [](const PyAutocast& a) { return a.dtype; });
  m.def("is_autocast_enabled", &amp::autocast_enabled);
  m.def("get_autocast_dtype", &amp::autocast_dtype);
  m.def("autocast_param_casts", &amp::autocast_param_casts,
        "casts of parameters since the counter was reset (once per parameter per scope)");
  m.def("reset_autocast_param_casts", &amp::reset_autocast_param_casts);

  py::class_<PyGradScaler>(m, "GradScaler")
      .def(py::init([](float init_scale, float growth_factor, float backoff_factor,
                       int64_t growth_interval, bool enabled) {
             return new PyGradScaler(amp::GradScalerOptions{
                 init_scale, growth_factor, backoff_factor, growth_interval, enabled});
           }),
           py::arg("init_scale") = 65536.0f, py::arg("growth_factor") = 2.0f,
           py::arg("backoff_factor") = 0.5f, py::arg("growth_interval") = 2000,
           py::arg("enabled") = true)
      .def(
          "scale",
          [](PyGradScaler& s, const Tensor& loss) {
            if (!s.scaler.enabled()) return loss;
            return mul(loss, reshape(s.scaler.scale_tensor(), {}));
          },
          py::arg("outputs"), py::call_guard<py::gil_scoped_release>(),
          "loss * scale, on the device (the loss unchanged when disabled)")
      .def(
          "unscale_", [](PyGradScaler& s, optim::Optimizer& opt) { s.unscale(opt); },
          py::arg("optimizer"), py::call_guard<py::gil_scoped_release>(),
          "divides the optimizer's gradients by the scale and checks them for inf/NaN (once per "
          "step, before clipping)")
      .def(
          "step",
          [](PyGradScaler& s, optim::Optimizer& opt, const py::object& grad_scale) {
            Tensor factor;
            if (!grad_scale.is_none()) factor = grad_scale.cast<Tensor>();
            py::gil_scoped_release nogil;
            if (!s.found_inf) s.unscale(opt);
            s.scaler.step_on_device(opt, *s.found_inf, factor);
          },
          py::arg("optimizer"), py::arg("grad_scale") = py::none(),
          "the optimizer's step, skipped on the device when the gradients held inf/NaN "
          "(grad_scale: a clip factor tensor folded into the update)")
      .def(
          "update",
          [](PyGradScaler& s, const py::object& new_scale) {
            if (!new_scale.is_none()) {
              const float v = new_scale.cast<float>();
              s.scaler.load_state({v, 0});
              s.found_inf.reset();
              return;
            }
            if (!s.found_inf)
              throw std::runtime_error(
                  "GradScaler.update(): no step() or unscale_() since the last update()");
            py::gil_scoped_release nogil;
            s.scaler.update(*s.found_inf);
            s.found_inf.reset();
          },
          py::arg("new_scale") = py::none())
      .def(
          "get_scale", [](const PyGradScaler& s) { return s.scaler.scale(); },
          "the scale (a host read; 1.0 when disabled)")
      .def_property_readonly("scale_tensor",
                             [](const PyGradScaler& s) { return s.scaler.scale_tensor(); })
      .def_property_readonly("found_inf",
                             [](const PyGradScaler& s) -> py::object {
                               if (!s.found_inf) return py::none();
                               return py::cast(*s.found_inf);
                             })
      .def("is_enabled", [](const PyGradScaler& s) { return s.scaler.enabled(); })
      .def("state_dict",
           [](const PyGradScaler& s) {
             py::dict d;
             if (!s.scaler.enabled()) return d;
             const amp::GradScalerState st = s.scaler.state();
             d["scale"] = st.scale;
             d["_growth_tracker"] = st.growth_tracker;
             return d;
           })
      .def("load_state_dict", [](PyGradScaler& s, const py::dict& d) {
        if (!s.scaler.enabled()) return;
        if (!d.contains("scale") || !d.contains("_growth_tracker"))
          throw py::key_error("GradScaler.load_state_dict: needs 'scale' and '_growth_tracker'");
        s.scaler.load_state({d["scale"].cast<float>(), d["_growth_tracker"].cast<int64_t>()});
      });
}

}  // namespace kuai::python
