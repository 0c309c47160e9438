// The parts of the kuai Python module, one function per binding file, and the conversions they
// share.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <vector>

#include "kuai/amp/grad_scaler.h"
#include "kuai/core/rng.h"
#include "kuai/core/tensor.h"

namespace kuai::python {

namespace py = pybind11;

void bind_tensor(py::module_& m);  // bind_tensor.cpp: Tensor, dtypes, devices, interchange, ops
void bind_nn(py::module_& m);      // bind_nn.cpp: Module, the layers, GPT and LLaMA
void bind_optim(py::module_& m);   // bind_optim.cpp: AdamW, SGD, schedules, clipping
void bind_train(py::module_& m);   // bind_train.cpp: data, the training step, memory counters
void bind_amp(py::module_& m);     // bind_amp.cpp: autocast, GradScaler
void bind_io(py::module_& m);      // bind_io.cpp: safetensors files, checksums

// The generator Python's kuai.manual_seed() seeds: what layers and random tensors draw from when
// no generator is given (torch's default generator).
Generator& default_generator();
// `gen` when given (a kuai.Generator), else the default one.
Generator& generator_or_default(const py::object& gen);

// A Python shape: an int, a sequence of ints, or several ints (*shape).
Shape to_shape(const py::handle& obj);
Shape shape_from_args(const py::args& args);
py::tuple shape_tuple(const Shape& s);

// kuai.amp.GradScaler: PyTorch's per-step protocol over the engine's scaler. unscale_ (optional,
// once per step) leaves its found_inf flag here for step and update; a compiled step
// (kuai.compile) uses the scaler itself.
struct PyGradScaler {
  explicit PyGradScaler(const amp::GradScalerOptions& o) : scaler(o) {}
  amp::GradScaler scaler;
  std::optional<Tensor> found_inf{};
  void unscale(optim::Optimizer& opt);  // throws when called twice before update()
};

// Every parameter of the optimizer's groups, in order.
std::vector<Tensor> optimizer_params(const optim::Optimizer& opt);

}  // namespace kuai::python
