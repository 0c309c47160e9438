// The kuai Python module (kuai._kuai): pybind11 bindings over the C++ library, no logic of their
// own beyond conversions between Python objects and kuai's types. Each bind_*.cpp binds one
// part; the Python package (python/kuai/) arranges them under PyTorch's names.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "kuai/core/version.h"

PYBIND11_MODULE(_kuai, m) {
  m.doc() = "kuai: a deep-learning training engine (C++ core, this is its binding)";
  m.attr("__version__") = kuai::kKuaiVersion;
  kuai::python::bind_tensor(m);
  kuai::python::bind_nn(m);
  kuai::python::bind_optim(m);
  kuai::python::bind_train(m);
  kuai::python::bind_tokenizer(m);
  kuai::python::bind_amp(m);
  kuai::python::bind_io(m);
  kuai::python::bind_dist(m);
  kuai::python::bind_log(m);
  kuai::python::bind_plan(m);
}
