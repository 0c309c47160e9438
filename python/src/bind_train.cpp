// Data and counters in Python: token files, the batch sources (random training windows,
// sequential held-out windows, synthetic tokens), the prefetching DataLoader, the allocator's
// memory counters and the host-read counters.
#include <pybind11/stl.h>

#include "bindings.h"
#include "kuai/amp/autocast.h"
#include "kuai/core/allocator.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/data/batch_source.h"
#include "kuai/data/loader.h"
#include "kuai/data/token_file.h"
#include "kuai/nn/gpt.h"
#include "kuai/train/train_step.h"

namespace kuai::python {

namespace {

using release = py::call_guard<py::gil_scoped_release>;
using data::BatchSource;

// The loader with the batch it handed out last: a batch's tensors view a slot buffer that the
// next call refills, so unless buffers are reused on purpose each batch is copied out.
struct PyLoader {
  std::unique_ptr<data::DataLoader> loader;
  bool reuse_buffers = false;
  py::tuple next() {
    data::Batch b;
    {
      py::gil_scoped_release nogil;
      b = loader->next();
      if (!reuse_buffers) {
        b.x = b.x.clone();
        b.y = b.y.clone();
      }
    }
    return py::make_tuple(b.x, b.y);
  }
};

py::dict stats_dict(const MemoryStats& s) {
  py::dict d;
  d["current"] = s.current;
  d["peak"] = s.peak;
  d["reserved"] = s.reserved;
  d["num_allocs"] = s.num_allocs;
  d["cache_hits"] = s.cache_hits;
  return d;
}

// kuai.compile(model, optimizer, ...) / kuai.TrainStep: train::TrainStep, holding the Python
// objects it refers to. The loss is the built-in GPT's own (no Python in the step) or a Python
// callable (x, y) -> loss, called with the GIL taken; a compiled step calls it only while it
// captures, and replays without Python after.
struct PyTrainStep {
  py::object model, optimizer, scaler_obj, loss_obj, ddp_obj;
  std::unique_ptr<amp::GradScaler> own_scaler{};
  std::unique_ptr<train::TrainStep> step{};

  py::object run(const std::function<data::Batch(int64_t)>& batch_at) {
    train::StepOutputs o;
    {
      py::gil_scoped_release nogil;
      o = step->step(batch_at);
    }
    py::dict d;
    d["loss"] = o.loss;
    d["grad_norm"] = o.grad_norm;
    d["skipped"] = o.skipped.defined() ? py::cast(o.skipped) : py::none();
    d["loss_scale"] = o.loss_scale.defined() ? py::cast(o.loss_scale) : py::none();
    return d;
  }
};

}  // namespace

void bind_train(py::module_& top) {
  py::module_ d = top.def_submodule("data", "kuai::data: token files, batch sources, the loader");

  py::class_<data::TokenFile, std::shared_ptr<data::TokenFile>>(d, "TokenFile")
      .def(py::init([](const std::string& path) {
             return std::make_shared<data::TokenFile>(data::TokenFile::open(path));
           }),
           py::arg("path"))
      .def("__len__", &data::TokenFile::size)
      .def("__getitem__", &data::TokenFile::operator[])
      .def_property_readonly("path", &data::TokenFile::path)
      .def_property_readonly("token_bytes", &data::TokenFile::token_bytes)
      .def("vocab_bound", &data::TokenFile::vocab_bound);
  d.def(
      "write_token_file",
      [](const std::string& path, const std::vector<int32_t>& tokens, int token_bytes) {
        data::write_token_file(path, tokens.data(), static_cast<int64_t>(tokens.size()),
                               token_bytes);
      },
      py::arg("path"), py::arg("tokens"), py::arg("token_bytes") = 1);

  py::class_<BatchSource, std::shared_ptr<BatchSource>>(d, "BatchSource")
      .def_property_readonly("batch_size", &BatchSource::batch_size)
      .def_property_readonly("seq_len", &BatchSource::seq_len)
      .def(
          "__getitem__",
          [](const BatchSource& s, int64_t index) {
            Tensor x = Tensor::empty({s.batch_size(), s.seq_len()}, DType::kI32, kCPU);
            Tensor y = Tensor::empty({s.batch_size(), s.seq_len()}, DType::kI32, kCPU);
            {
              py::gil_scoped_release nogil;
              s.fill(index, x.data<int32_t>(), y.data<int32_t>());
            }
            return py::make_tuple(x, y);
          },
          py::arg("index"));
  py::class_<data::RandomWindows, BatchSource, std::shared_ptr<data::RandomWindows>>(
      d, "RandomWindows")
      .def(py::init([](std::shared_ptr<data::TokenFile> file, int64_t batch_size, int64_t seq_len,
                       uint64_t seed, int64_t begin, const std::optional<int64_t>& end, int rank,
                       int world_size) {
             const int64_t stop = end.value_or(file->size());
             return std::make_shared<data::RandomWindows>(std::move(file), begin, stop, batch_size,
                                                          seq_len, seed, rank, world_size);
           }),
           py::arg("file"), py::arg("batch_size"), py::arg("seq_len"), py::kw_only(),
           py::arg("seed") = 0, py::arg("begin") = 0, py::arg("end") = py::none(),
           py::arg("rank") = 0, py::arg("world_size") = 1);
  py::class_<data::SequentialWindows, BatchSource, std::shared_ptr<data::SequentialWindows>>(
      d, "SequentialWindows")
      .def(py::init([](std::shared_ptr<data::TokenFile> file, int64_t batch_size, int64_t seq_len,
                       int64_t begin, const std::optional<int64_t>& end, int rank, int world_size) {
             const int64_t stop = end.value_or(file->size());
             return std::make_shared<data::SequentialWindows>(
                 std::move(file), begin, stop, batch_size, seq_len, rank, world_size);
           }),
           py::arg("file"), py::arg("batch_size"), py::arg("seq_len"), py::kw_only(),
           py::arg("begin") = 0, py::arg("end") = py::none(), py::arg("rank") = 0,
           py::arg("world_size") = 1)
      .def_property_readonly("num_windows", &data::SequentialWindows::num_windows);
  py::class_<data::SyntheticTokens, BatchSource, std::shared_ptr<data::SyntheticTokens>>(
      d, "SyntheticTokens")
      .def(py::init<int64_t, int64_t, int64_t, uint64_t, int, int>(), py::arg("vocab_size"),
           py::arg("batch_size"), py::arg("seq_len"), py::kw_only(), py::arg("seed") = 0,
           py::arg("rank") = 0, py::arg("world_size") = 1);

  // kuai.data.DataLoader(source, num_workers=2, prefetch_factor=2): iterating yields (x, y),
  // (B, T) int32, batch after batch in index order (the sources are endless: stop when done).
  py::class_<PyLoader>(d, "DataLoader")
      .def(py::init([](std::shared_ptr<BatchSource> source, int num_workers, int prefetch_factor,
                       int64_t start_index, bool reuse_buffers) {
             auto l = std::make_unique<PyLoader>();
             data::LoaderOptions o;
             o.workers = num_workers;
             o.prefetch_factor = prefetch_factor;
             l->loader = std::make_unique<data::DataLoader>(std::move(source), o, start_index);
             l->reuse_buffers = reuse_buffers;
             return l;
           }),
           py::arg("source"), py::kw_only(), py::arg("num_workers") = 2,
           py::arg("prefetch_factor") = 2, py::arg("start_index") = 0,
           py::arg("reuse_buffers") = false)
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", &PyLoader::next)
      .def("next", &PyLoader::next)
      .def("state_dict",
           [](const PyLoader& l) {
             py::dict s;
             s["next_index"] = l.loader->state().next_index;
             return s;
           })
      .def("load_state_dict",
           [](PyLoader& l, const py::dict& s) {
             const data::LoaderState st{s["next_index"].cast<int64_t>()};
             py::gil_scoped_release nogil;
             l.loader->load_state(st);
           })
      .def_property_readonly("last_wait_ms",
                             [](const PyLoader& l) { return l.loader->last_wait_ms(); })
      .def_property_readonly("num_slots", [](const PyLoader& l) { return l.loader->num_slots(); });

  // ---- the training step ----
  py::class_<PyTrainStep>(top, "TrainStep")
      .def(py::init([](py::object model, py::object optimizer, py::object loss_fn,
                       int64_t accumulation_steps, const std::string& precision,
                       float max_grad_norm, py::object scaler, bool compile, py::object ddp) {
             auto s = std::make_unique<PyTrainStep>();
             s->model = model;
             s->optimizer = optimizer;
             s->loss_obj = loss_fn;
             s->ddp_obj = ddp;
             train::StepOptions o;
             o.accum_steps = accumulation_steps;
             o.compute = amp::precision_dtype(precision);
             o.grad_clip = max_grad_norm;
             o.compile = compile;
             amp::GradScaler* sc = nullptr;
             if (!scaler.is_none()) {
               s->scaler_obj = scaler;
               sc = &scaler.cast<PyGradScaler&>().scaler;
             } else {
               amp::GradScalerOptions so;
               so.enabled = o.compute == DType::kF16;
               s->own_scaler = std::make_unique<amp::GradScaler>(so);
               sc = s->own_scaler.get();
             }
             if (o.compute == DType::kF16 && !sc->enabled())
               throw py::value_error("TrainStep: precision \"fp16\" needs an enabled GradScaler");
             nn::Module& m = model.cast<nn::Module&>();
             train::TrainStep::LossFn loss;
             if (!loss_fn.is_none()) {
               py::object fn = loss_fn;
               loss = [fn](const Tensor& x, const Tensor& y) {
                 py::gil_scoped_acquire gil;
                 return fn(x, y).cast<Tensor>();
               };
             } else if (auto* gpt = dynamic_cast<nn::GPT*>(&m)) {
               loss = [gpt](const Tensor& x, const Tensor& y) { return gpt->loss(x, y); };
             } else {
               py::object fn = model;
               loss = [fn](const Tensor& x, const Tensor& y) {
                 py::gil_scoped_acquire gil;
                 return fn(x, y).cast<Tensor>();
               };
             }
             optim::Optimizer& opt = optimizer.cast<optim::Optimizer&>();
             // DDP's reducer (kuai.nn.parallel.DistributedDataParallel's) and ZeRO's optimizer:
             // the engine's step drives them itself (no_sync, the wait, the sharded update).
             dist::DistributedDataParallel* reducer =
                 ddp.is_none() ? nullptr : ddp.cast<PyDDP&>().ddp.get();
             auto* zero = dynamic_cast<dist::ZeroAdamW*>(&opt);
             if (zero && zero->stage() == 2 && !reducer)
               throw py::value_error("TrainStep: ZeRO stage 2 shards DDP's buckets: pass ddp=");
             s->step =
                 std::make_unique<train::TrainStep>(m, std::move(loss), opt, *sc, o, reducer, zero);
             return s;
           }),
           py::arg("model"), py::arg("optimizer"), py::kw_only(), py::arg("loss_fn") = py::none(),
           py::arg("accumulation_steps") = 1, py::arg("precision") = "fp32",
           py::arg("max_grad_norm") = 1.0f, py::arg("scaler") = py::none(),
           py::arg("compile") = false, py::arg("ddp") = py::none())
      .def(
          "__call__",
          [](PyTrainStep& s, const Tensor& x, const Tensor& y) {
            if (s.step->options().accum_steps != 1)
              throw py::value_error("TrainStep(x, y) takes one batch; with accumulation_steps = " +
                                    std::to_string(s.step->options().accum_steps) +
                                    " pass a list of (x, y) or a DataLoader");
            const data::Batch b{x, y};
            return s.run([&](int64_t) { return b; });
          },
          py::arg("x"), py::arg("y"))
      .def("__call__",
           [](PyTrainStep& s, PyLoader& loader) {
             return s.run([&](int64_t) { return loader.loader->next(); });
           })
      .def("__call__",
           [](PyTrainStep& s, const std::vector<std::pair<Tensor, Tensor>>& batches) {
             std::vector<data::Batch> bs;
             for (const auto& [x, y] : batches) bs.push_back({x, y});
             if (static_cast<int64_t>(bs.size()) != s.step->options().accum_steps)
               throw py::value_error("TrainStep: got " + std::to_string(bs.size()) +
                                     " micro-batches, accumulation_steps is " +
                                     std::to_string(s.step->options().accum_steps));
             return s.run([&](int64_t i) { return bs[static_cast<size_t>(i)]; });
           })
      .def_property_readonly("compiled",
                             [](const PyTrainStep& s) { return s.step->compiled() != nullptr; })
      .def_property_readonly("captures",
                             [](const PyTrainStep& s) {
                               return s.step->compiled() ? s.step->compiled()->captures()
                                                         : int64_t{0};
                             })
      .def_property_readonly("replays",
                             [](const PyTrainStep& s) {
                               return s.step->compiled() ? s.step->compiled()->replays()
                                                         : int64_t{0};
                             })
      .def("release_memory", [](PyTrainStep& s) { s.step->release_memory(); });

  // ---- counters ----
  py::module_ mem = top.def_submodule("memory", "the tracking allocator's counters (CPU)");
  mem.def("stats", [] { return stats_dict(Allocator::get().stats(kCPU)); });
  mem.def("memory_allocated", [] { return Allocator::get().stats(kCPU).current; });
  mem.def("max_memory_allocated", [] { return Allocator::get().stats(kCPU).peak; });
  mem.def("memory_reserved", [] { return Allocator::get().stats(kCPU).reserved; });
  mem.def("reset_peak_memory_stats", [] { Allocator::get().reset_peak(kCPU); });
  mem.def("empty_cache", [] { Allocator::get().empty_cache(kCPU); });
  top.def("host_reads", &host_reads_total,
          "host reads of device values made so far (by every thread)");
  top.def("host_reads_this_thread", &host_reads_this_thread);
}

}  // namespace kuai::python
