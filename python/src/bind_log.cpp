// Metrics without per-step host reads in Python (technique 10): kuai::log::MetricRing with its
// TensorBoard and JSONL sinks. The training loop pushes device scalars (a loss, a norm) without
// reading them; the ring's logger thread converts them `lag` steps later and writes the event
// file. kuai.utils.tensorboard.SummaryWriter is the Python face of it.
#include <pybind11/stl.h>

#include <chrono>

#include "bindings.h"
#include "kuai/core/ops.h"
#include "kuai/log/metrics.h"
#include "kuai/log/sinks.h"

namespace kuai::python {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct PyMetricLog {
  std::unique_ptr<log::MetricRing> ring;
  std::string event_file;
};

}  // namespace

void bind_log(py::module_& top) {
  py::module_ m = top.def_submodule("log", "kuai::log: the metric ring and its writers");
  py::class_<PyMetricLog>(m, "MetricLog")
      .def(py::init([](const std::string& tensorboard_dir, const std::string& jsonl_path,
                       const std::string& prefix, int64_t lag, int64_t capacity) {
             std::vector<std::unique_ptr<log::MetricSink>> sinks;
             auto r = std::make_unique<PyMetricLog>();
             if (!tensorboard_dir.empty()) {
               auto tb = std::make_unique<log::TensorBoardSink>(tensorboard_dir, prefix);
               r->event_file = tb->path();
               sinks.push_back(std::move(tb));
             }
             if (!jsonl_path.empty()) sinks.push_back(std::make_unique<log::JsonlSink>(jsonl_path));
             r->ring = std::make_unique<log::MetricRing>(std::move(sinks), lag, capacity);
             return r;
           }),
           py::arg("tensorboard_dir") = "", py::arg("jsonl_path") = "", py::arg("prefix") = "",
           py::arg("lag") = 2, py::arg("capacity") = 0)
      .def(
          "push",
          [](PyMetricLog& l, int64_t step,
             const std::vector<std::pair<std::string, Tensor>>& device,
             const std::vector<std::pair<std::string, double>>& host, py::object wall_time) {
            log::StepMetrics s;
            s.step = step;
            s.wall_time = wall_time.is_none() ? now_seconds() : wall_time.cast<double>();
            for (const auto& [name, t] : device) {
              if (t.numel() != 1)
                throw py::value_error("add_scalar(\"" + name +
                                      "\"): a scalar needs one element, got " + t.str());
              s.device.emplace_back(name, t.detach());  // read later by the logger thread
            }
            s.host = host;
            py::gil_scoped_release nogil;
            l.ring->push(std::move(s));
          },
          py::arg("step"), py::arg("device"), py::arg("host"), py::arg("wall_time") = py::none(),
          "never reads a device value on this thread")
      .def(
          "flush", [](PyMetricLog& l) { l.ring->flush(); },
          py::call_guard<py::gil_scoped_release>())
      .def("close",
           [](PyMetricLog& l) {
             if (!l.ring) return;
             py::gil_scoped_release nogil;
             l.ring->flush();
             l.ring.reset();
           })
      .def_property_readonly("event_file", [](const PyMetricLog& l) { return l.event_file; })
      .def("history", [](const PyMetricLog& l) {
        py::list out;
        if (!l.ring) return out;
        for (const log::LoggedStep& s : l.ring->history()) {
          py::dict d;
          d["step"] = s.step;
          d["wall_time"] = s.wall_time;
          for (const auto& [name, v] : s.values) d[py::str(name)] = v;
          out.append(d);
        }
        return out;
      });
}

}  // namespace kuai::python
