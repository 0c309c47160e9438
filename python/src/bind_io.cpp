// Files in Python: safetensors reading and writing over kuai::io (kuai.save and kuai.load in the
// package arrange a state dict's tree over these), and the xxh3 checksum of a tensor's bytes.
#include <pybind11/stl.h>

#include "bindings.h"
#include "kuai/io/checksum.h"
#include "kuai/io/safetensors.h"
#include "kuai/io/tensor_io.h"

namespace kuai::python {

void bind_io(py::module_& top) {
  py::module_ m = top.def_submodule("io", "kuai::io: safetensors files and checksums");

  m.def("save_file", &io::save_safetensors, py::arg("path"), py::arg("tensors"),
        py::arg("metadata") = std::map<std::string, std::string>{},
        py::call_guard<py::gil_scoped_release>(),
        "writes (name, tensor) pairs in order and string metadata to path atomically (path.tmp, "
        "fsync, rename): a good file is never replaced by a partial one");
  m.def(
      "load_file",
      [](const std::string& path) {
        std::vector<std::pair<std::string, Tensor>> tensors;
        std::map<std::string, std::string> metadata;
        {
          py::gil_scoped_release nogil;
          const io::SafetensorsFile f = io::SafetensorsFile::open(path);
          for (const io::SafetensorsEntry& e : f.entries())
            tensors.emplace_back(e.name, io::read_tensor(f, e.name));
          metadata = f.metadata();
        }
        return py::make_tuple(tensors, metadata);
      },
      py::arg("path"),
      "(list of (name, tensor) in the header's order, metadata): the file validated, its tensors "
      "copied into CPU tensors");
  m.def(
      "checksum",
      [](const Tensor& t) {
        const Tensor c = t.to(kCPU).contiguous();
        return io::xxh3_hex(c.raw_data(), static_cast<size_t>(c.nbytes()));
      },
      py::arg("tensor"), py::call_guard<py::gil_scoped_release>(),
      "\"xxh3:<16 hex>\" of the tensor's bytes as a file stores them");
}

}  // namespace kuai::python
