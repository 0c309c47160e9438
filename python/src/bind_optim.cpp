// Optimizers in Python: kuai.optim.AdamW and SGD over kuai::optim (parameter groups given as
// PyTorch's: a list of tensors, or of dicts with "params" and "weight_decay"), the warmup-cosine
// schedule the trainer uses, and gradient clipping.
#include <pybind11/stl.h>

#include "bindings.h"
#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/optim/schedule.h"
#include "kuai/optim/sgd.h"

namespace kuai::python {

std::vector<optim::ParamGroup> param_groups(const py::iterable& params, float weight_decay) {
  std::vector<optim::ParamGroup> groups;
  optim::ParamGroup plain{{}, weight_decay};
  for (const py::handle h : params) {
    if (py::isinstance<py::dict>(h)) {
      const auto d = h.cast<py::dict>();
      if (!d.contains("params")) throw py::key_error("parameter group without 'params'");
      for (auto [k, v] : d) {
        const auto key = k.cast<std::string>();
        if (key != "params" && key != "weight_decay")
          throw py::key_error("parameter group key '" + key +
                              "' (kuai's groups take 'params' and 'weight_decay'; the learning "
                              "rate and betas are the optimizer's)");
      }
      optim::ParamGroup g{
          d["params"].cast<std::vector<Tensor>>(),
          d.contains("weight_decay") ? d["weight_decay"].cast<float>() : weight_decay};
      groups.push_back(std::move(g));
    } else {
      plain.params.push_back(h.cast<Tensor>());
    }
  }
  if (!plain.params.empty()) groups.insert(groups.begin(), std::move(plain));
  if (groups.empty()) throw py::value_error("optimizer got an empty parameter list");
  return groups;
}

namespace {

using release = py::call_guard<py::gil_scoped_release>;

std::string meta(const Tensor& t) {
  return shape_str(t.shape()) + " " + std::string(dtype_name(t.dtype()));
}

// PyTorch's layout: {"state": {index: {name: tensor}}, "param_groups": [{"params": [index...],
// "weight_decay", "lr"}]} with parameters numbered across groups in order, plus kuai's one step
// count ("step": PyTorch keeps a step per parameter; kuai's optimizer has one). The tensors are the
// optimizer's own (as PyTorch's state_dict gives references); kuai.save copies them out.
py::dict optimizer_state_dict(optim::Optimizer& o) {
  py::dict state;
  const auto named = o.named_state();
  py::list groups;
  int64_t index = 0;
  for (size_t gi = 0; gi < o.groups().size(); ++gi) {
    py::list ids;
    for (size_t i = 0; i < o.groups()[gi].params.size(); ++i, ++index) {
      ids.append(index);
      if (named.empty()) continue;
      py::dict per;
      for (const auto& n : named) per[py::str(n.name)] = (*n.tensors)[gi][i];
      state[py::int_(index)] = per;
    }
    py::dict g;
    g["params"] = ids;
    g["weight_decay"] = o.groups()[gi].weight_decay;
    g["lr"] = o.lr();
    groups.append(g);
  }
  py::dict d;
  d["state"] = state;
  d["param_groups"] = groups;
  d["step"] = o.step_count();
  return d;
}

// Checks everything (group sizes, every state tensor's presence, shape and dtype) before writing
// anything, then copies in place and sets the step count and the learning rate.
void load_optimizer_state_dict(optim::Optimizer& o, const py::dict& d) {
  for (const char* key : {"state", "param_groups", "step"})
    if (!d.contains(key))
      throw py::key_error(std::string("optimizer state_dict without '") + key + "'");
  const auto groups = d["param_groups"].cast<py::list>();
  if (groups.size() != o.groups().size())
    throw py::value_error("optimizer state_dict has " + std::to_string(groups.size()) +
                          " parameter groups, the optimizer " + std::to_string(o.groups().size()));
  const auto state = d["state"].cast<py::dict>();
  const auto named = o.named_state();
  std::vector<std::pair<Tensor, Tensor>> copies;  // (destination, source)
  int64_t index = 0;
  for (size_t gi = 0; gi < o.groups().size(); ++gi) {
    const auto ids = groups[gi].cast<py::dict>()["params"].cast<py::list>();
    if (ids.size() != o.groups()[gi].params.size())
      throw py::value_error("optimizer state_dict: group " + std::to_string(gi) + " has " +
                            std::to_string(ids.size()) + " parameters, the optimizer's " +
                            std::to_string(o.groups()[gi].params.size()));
    for (size_t i = 0; i < o.groups()[gi].params.size(); ++i, ++index) {
      if (named.empty()) continue;
      const py::int_ key(index);
      if (!state.contains(key))
        throw py::key_error("optimizer state_dict: no state for parameter " +
                            std::to_string(index));
      const auto per = state[key].cast<py::dict>();
      for (const auto& n : named) {
        if (!per.contains(n.name))
          throw py::key_error("optimizer state_dict: parameter " + std::to_string(index) +
                              " has no '" + n.name + "'");
        const Tensor src = per[py::str(n.name)].cast<Tensor>();
        const Tensor& dst = (*n.tensors)[gi][i];
        if (src.shape() != dst.shape() || src.dtype() != dst.dtype())
          throw py::value_error("optimizer state_dict: parameter " + std::to_string(index) + " '" +
                                n.name + "' is " + meta(src) + ", the optimizer's " + meta(dst));
        copies.emplace_back(dst, src);
      }
    }
  }
  const int64_t step = d["step"].cast<int64_t>();
  const float lr = groups[0].cast<py::dict>().contains("lr")
                       ? groups[0].cast<py::dict>()["lr"].cast<float>()
                       : o.lr();
  py::gil_scoped_release nogil;
  autograd::NoGradGuard no_grad;
  for (auto& [dst, src] : copies) dst.copy_(src);
  o.set_step_count(step);
  o.set_lr(lr);
}

}  // namespace

void bind_optim(py::module_& top) {
  py::module_ m = top.def_submodule("optim", "kuai::optim: optimizers and schedules");

  py::class_<optim::Optimizer>(m, "Optimizer")
      .def(
          "step",
          [](optim::Optimizer& o, const py::object& grad_scale) {
            if (grad_scale.is_none()) {
              py::gil_scoped_release nogil;
              o.step(1.0f);
            } else if (py::isinstance<Tensor>(grad_scale)) {
              const Tensor s = grad_scale.cast<Tensor>();
              py::gil_scoped_release nogil;
              o.step(s);
            } else {
              const float s = grad_scale.cast<float>();
              py::gil_scoped_release nogil;
              o.step(s);
            }
          },
          py::arg("grad_scale") = py::none())
      .def(
          "zero_grad", [](optim::Optimizer& o, bool) { o.zero_grad(); },
          py::arg("set_to_none") = true)
      .def_property("lr", &optim::Optimizer::lr, &optim::Optimizer::set_lr)
      .def("set_lr", &optim::Optimizer::set_lr)
      .def_property("step_count", &optim::Optimizer::step_count, &optim::Optimizer::set_step_count)
      .def("state_dict", &optimizer_state_dict)
      .def("load_state_dict", &load_optimizer_state_dict, py::arg("state_dict"))
      .def_property_readonly("param_groups", [](const optim::Optimizer& o) {
        py::list out;
        for (const auto& g : o.groups()) {
          py::dict d;
          d["params"] = g.params;
          d["weight_decay"] = g.weight_decay;
          d["lr"] = o.lr();
          out.append(d);
        }
        return out;
      });

  py::class_<optim::AdamW, optim::Optimizer>(m, "AdamW")
      .def(py::init([](const py::iterable& params, float lr, std::pair<float, float> betas,
                       float eps, float weight_decay) {
             return new optim::AdamW(param_groups(params, weight_decay),
                                     {lr, betas.first, betas.second, eps});
           }),
           py::arg("params"), py::arg("lr") = 1e-3f,
           py::arg("betas") = std::pair<float, float>(0.9f, 0.999f), py::arg("eps") = 1e-8f,
           py::arg("weight_decay") = 1e-2f, py::keep_alive<1, 2>())
      .def("exp_avg", &optim::AdamW::exp_avg)
      .def("exp_avg_sq", &optim::AdamW::exp_avg_sq);

  py::class_<optim::SGD, optim::Optimizer>(m, "SGD").def(
      py::init([](const py::iterable& params, float lr, float momentum, float dampening,
                  float weight_decay, bool nesterov) {
        return new optim::SGD(param_groups(params, weight_decay),
                              {lr, momentum, dampening, nesterov});
      }),
      py::arg("params"), py::arg("lr") = 1e-2f, py::arg("momentum") = 0.0f,
      py::arg("dampening") = 0.0f, py::arg("weight_decay") = 0.0f, py::arg("nesterov") = false);

  py::module_ sched = m.def_submodule("lr_scheduler", "learning-rate schedules");
  py::class_<optim::WarmupCosineLR>(sched, "WarmupCosineLR")
      .def(py::init<optim::Optimizer&, int64_t, int64_t, double, double>(), py::arg("optimizer"),
           py::arg("warmup_steps"), py::arg("total_steps"), py::arg("min_lr_ratio") = 0.1,
           py::arg("base_lr") = -1.0, py::keep_alive<1, 2>())
      .def("step", &optim::WarmupCosineLR::step)
      .def("get_last_lr",
           [](const optim::WarmupCosineLR& s) { return std::vector<double>{s.lr()}; })
      .def_property_readonly("last_epoch", &optim::WarmupCosineLR::last_step);
  m.def("warmup_cosine_lr", &optim::warmup_cosine_lr, py::arg("lr"), py::arg("warmup_steps"),
        py::arg("total_steps"), py::arg("min_lr_ratio"), py::arg("step"));

  // Clipping (kuai.nn.utils re-exports these under PyTorch's names). clip_grad_norm_ scales the
  // gradients by the factor on the device (no host read) and returns the norm, a () tensor.
  m.def("grad_norm", &optim::grad_norm_tensor, py::arg("parameters"), release());
  m.def("clip_coefficient", py::overload_cast<const Tensor&, float>(&optim::clip_coefficient),
        py::arg("norm"), py::arg("max_norm"), release());
  m.def(
      "clip_grad_norm_",
      [](const std::vector<Tensor>& params, float max_norm) {
        const Tensor norm = optim::grad_norm_tensor(params);
        const Tensor c = optim::clip_coefficient(norm, max_norm);
        autograd::NoGradGuard no_grad;
        const Tensor factor = reshape(c, {});
        for (const Tensor& p : params) {
          Tensor t = p;
          if (t.grad().defined()) t.set_grad(mul(t.grad(), factor));
        }
        return reshape(norm, {});
      },
      py::arg("parameters"), py::arg("max_norm"), release());
}

}  // namespace kuai::python
