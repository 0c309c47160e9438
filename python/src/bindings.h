// The parts of the kuai Python module, one function per binding file, and the conversions they
// share.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <vector>

#include "kuai/amp/grad_scaler.h"
#include "kuai/core/rng.h"
#include "kuai/core/tensor.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/zero3.h"
#include "kuai/nn/gpt.h"

namespace kuai::python {

namespace py = pybind11;

void bind_tensor(py::module_& m);     // bind_tensor.cpp: Tensor, dtypes, devices, interchange, ops
void bind_nn(py::module_& m);         // bind_nn.cpp: Module, the layers, GPT and LLaMA
void bind_optim(py::module_& m);      // bind_optim.cpp: AdamW, SGD, schedules, clipping
void bind_train(py::module_& m);      // bind_train.cpp: data, the training step, memory counters
void bind_amp(py::module_& m);        // bind_amp.cpp: autocast, GradScaler
void bind_io(py::module_& m);         // bind_io.cpp: safetensors files, checksums
void bind_dist(py::module_& m);       // bind_dist.cpp: process groups, DDP, ZeRO, offload
void bind_log(py::module_& m);        // bind_log.cpp: the metric ring, TensorBoard and JSONL
void bind_plan(py::module_& m);       // bind_plan.cpp: kuai.plan on a Python-built model
void bind_tokenizer(py::module_& m);  // bind_tokenizer.cpp: tokenizer.json, byte, GPT-2

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

// The reducer with the module it reduces kept alive. queue_finish() asks autograd to wait for the
// buckets at the end of the coming backward, so `loss.backward()` returns with averaged gradients.
// (kuai.nn.parallel.DistributedDataParallel holds one.)
struct PyDDP {
  py::object module;
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  bool finish_queued = false;
  // ZeRO-3 (kuai.distributed.fsdp.fully_shard): the GPT's units, one bucket each; the sharded
  // parameters are made with the stage-3 optimizer (ZeroRedundancyOptimizer(stage=3, ddp=...)).
  nn::GPT* gpt = nullptr;
  dist::Zero3Options zero3{};
  std::vector<Tensor> low;  // gathered in zero3.gather_dtype
  std::shared_ptr<dist::ShardedParameters> sharded;
  ~PyDDP() {
    if (gpt != nullptr && sharded) gpt->set_unit_hooks(nullptr);
  }
};

// PyTorch's parameter groups (a list of tensors, or of dicts with "params" and "weight_decay").
std::vector<optim::ParamGroup> param_groups(const py::iterable& params, float weight_decay);

// Every parameter of the optimizer's groups, in order.
std::vector<Tensor> optimizer_params(const optim::Optimizer& opt);

}  // namespace kuai::python
