// Data and counters in Python: token files, the batch sources (random training windows,
// sequential held-out windows, synthetic tokens), the prefetching DataLoader, the allocator's
// memory counters and the host-read counters.
#include <pybind11/stl.h>

#include "bindings.h"
#include "kuai/core/allocator.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/data/batch_source.h"
#include "kuai/data/loader.h"
#include "kuai/data/token_file.h"

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
