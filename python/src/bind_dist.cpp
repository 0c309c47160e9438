// Multi-process training in Python (under mpirun): the process group (kuai.distributed's
// init_process_group, rank, world size, collectives, their byte counters), DDP over a module
// (kuai::dist::DistributedDataParallel: buckets, overlap, no_sync, compression), ZeRO's sharded
// AdamW (kuai::dist::ZeroAdamW) and AdamW with its moments offloaded to disk
// (kuai::optim::OffloadedAdamW). The Python package wraps DDP as a module with PyTorch's calls.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "kuai/amp/autocast.h"
#include "kuai/core/autograd.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/process_group.h"
#include "kuai/distributed/zero.h"
#include "kuai/distributed/zero3.h"
#include "kuai/nn/layers.h"
#include "kuai/nn/module.h"
#include "kuai/optim/offload_adamw.h"

namespace kuai::python {

namespace {

using release = py::call_guard<py::gil_scoped_release>;

struct PyWholeUnits {
  std::shared_ptr<dist::ShardedParameters> sharded;
  std::unique_ptr<dist::ShardedParameters::Whole> whole;
};

std::shared_ptr<dist::ProcessGroup>& default_group() {
  static std::shared_ptr<dist::ProcessGroup> g;
  return g;
}

dist::ProcessGroup& group_or_throw() {
  if (!default_group())
    throw std::runtime_error(
        "kuai.distributed: call init_process_group() first (under mpirun for several ranks)");
  return *default_group();
}

dist::ReduceOp reduce_op(const std::string& op) {
  if (op == "sum") return dist::ReduceOp::kSum;
  if (op == "avg") return dist::ReduceOp::kAvg;
  throw py::value_error("all_reduce: op must be \"sum\" or \"avg\", got \"" + op + "\"");
}

py::dict stats_dict(const dist::ProcessGroup::CollectiveStats& s) {
  py::dict d;
  d["calls"] = s.calls;
  d["bytes_sent"] = s.bytes_sent;
  d["bytes_received"] = s.bytes_received;
  d["bytes_sent_in_backward"] = s.bytes_sent_in_backward;
  d["seconds"] = s.seconds;
  d["seconds_in_backward"] = s.seconds_in_backward;
  return d;
}

}  // namespace

void bind_dist(py::module_& top) {
  py::module_ m = top.def_submodule("distributed", "kuai::dist: process groups, DDP, ZeRO");

  m.def("is_available", &dist::mpi_compiled, "whether this build has MPI");
  m.def("launched_by_mpi", &dist::launched_by_mpi);
  m.def(
      "init_process_group",
      [](const std::string& backend, double timeout_s) {
        if (default_group()) return;
        dist::ProcessGroupOptions o;
        o.timeout_s = timeout_s;
        if (backend == "mpi")
          default_group() = dist::mpi_process_group(o);
        else if (backend == "single")
          default_group() = dist::single_process_group();
        else if (backend.empty())
          default_group() = dist::default_process_group(o);
        else
          throw py::value_error("init_process_group: backend \"" + backend +
                                "\": kuai has \"mpi\" (under mpirun) and \"single\"");
      },
      py::arg("backend") = "", py::arg("timeout") = 300.0, release(),
      "MPI when launched by mpirun (or backend=\"mpi\"), else one process");
  m.def("is_initialized", [] { return default_group() != nullptr; });
  m.def("get_rank", [] { return default_group() ? default_group()->rank() : 0; });
  m.def("get_world_size", [] { return default_group() ? default_group()->size() : 1; });
  m.def("get_backend", [] { return group_or_throw().backend(); });
  m.def(
      "all_reduce",
      [](const Tensor& t, const std::string& op) {
        group_or_throw().all_reduce(t, reduce_op(op))->wait();
      },
      py::arg("tensor"), py::arg("op") = "sum", release(), "in place, over every rank");
  m.def(
      "broadcast", [](const Tensor& t, int src) { group_or_throw().broadcast(t, src)->wait(); },
      py::arg("tensor"), py::arg("src") = 0, release());
  m.def(
      "all_gather_into_tensor",
      [](const Tensor& out, const Tensor& in) { group_or_throw().all_gather(in, out)->wait(); },
      py::arg("output"), py::arg("input"), release());
  m.def(
      "barrier", [] { group_or_throw().barrier(); }, release());
  m.def(
      "collective_stats", [] { return stats_dict(group_or_throw().total_stats()); },
      "what this rank has launched so far: calls, bytes sent and received (all collectives)");
  m.def(
      "destroy_process_group",
      [] {
        if (!default_group()) return;
        default_group().reset();
        dist::finalize();
      },
      release(), "the queued collectives complete and MPI is finalised (every rank calls it)");

  // Every unit gathered while the context lives (FSDP's summon_full_params): a collective.
  py::class_<PyWholeUnits>(m, "_WholeUnits")
      .def("__enter__",
           [](PyWholeUnits& w) {
             std::vector<size_t> all(w.sharded->num_units());
             for (size_t u = 0; u < all.size(); ++u) all[u] = u;
             py::gil_scoped_release nogil;
             w.whole = std::make_unique<dist::ShardedParameters::Whole>(*w.sharded, all);
           })
      .def("__exit__", [](PyWholeUnits& w, py::args) {
        py::gil_scoped_release nogil;
        w.whole.reset();
      });

  py::class_<PyDDP>(m, "_Reducer")
      .def(py::init([](py::object module, double bucket_cap_mb, double first_bucket_mb,
                       bool overlap, bool find_unused, const std::string& compression,
                       bool error_feedback, bool zero3, bool reshard_after_forward, int prefetch,
                       const std::string& gather_dtype) {
             dist::DDPOptions o;
             o.bucket_mb = bucket_cap_mb;
             o.first_bucket_mb = first_bucket_mb;
             o.overlap = overlap;
             o.find_unused = find_unused;
             o.compression = dist::parse_compression(compression);
             o.error_feedback = error_feedback;
             nn::Module& mod = module.cast<nn::Module&>();
             auto r = std::make_unique<PyDDP>();
             r->module = module;
             std::shared_ptr<dist::ProcessGroup> g = default_group();
             if (!g)
               throw std::runtime_error("DistributedDataParallel: call init_process_group() first");
             std::vector<std::vector<Tensor>> layout;
             if (zero3) {  // one bucket per unit of the GPT, reduce-scattered into the shards
               r->gpt = dynamic_cast<nn::GPT*>(&mod);
               if (r->gpt == nullptr)
                 throw py::type_error(
                     "fully_shard: kuai shards a model by its units (the embedding, each block, "
                     "the head), which kuai.nn.GPT names; got another module");
               if (prefetch < 0) throw py::value_error("fully_shard: prefetch must be >= 0");
               r->zero3 = {
                   reshard_after_forward, prefetch,
                   gather_dtype == "fp32" ? DType::kF32 : amp::precision_dtype(gather_dtype)};
               if (r->zero3.gather_dtype != DType::kF32) r->low = nn::product_parameters(*r->gpt);
               layout = dist::ShardedParameters::bucket_layout(r->gpt->units(), r->low);
               o.sharded = true;
             }
             py::gil_scoped_release nogil;
             r->ddp = std::make_shared<dist::DistributedDataParallel>(mod, g, o, layout);
             return r;
           }),
           py::arg("module"), py::arg("bucket_cap_mb"), py::arg("first_bucket_mb"),
           py::arg("overlap"), py::arg("find_unused_parameters"), py::arg("compression"),
           py::arg("error_feedback"), py::arg("zero3") = false,
           py::arg("reshard_after_forward") = true, py::arg("prefetch") = 1,
           py::arg("gather_dtype") = "fp32")
      .def_property_readonly("zero3_ready", [](const PyDDP& r) { return r.sharded != nullptr; })
      .def(
          "summon_full_params",
          [](PyDDP& r) {
            if (!r.sharded)
              throw std::runtime_error(
                  "summon_full_params: the model's parameters are not sharded");
            auto w = std::make_unique<PyWholeUnits>();
            w->sharded = r.sharded;
            return w;
          },
          py::keep_alive<0, 1>())
      .def(
          "prepare_backward",
          [](PyDDP& r, bool sync) {
            r.ddp->restore_grad_views();
            r.ddp->prepare_backward(sync);
            // Queued once per synchronising backward (a backward that failed dropped it).
            if (sync && (!r.finish_queued || autograd::queued_callbacks() == 0)) {
              r.finish_queued = true;
              std::weak_ptr<dist::DistributedDataParallel> weak = r.ddp;
              PyDDP* self = &r;
              autograd::queue_callback([weak, self] {
                if (auto d = weak.lock()) {
                  self->finish_queued = false;
                  d->finish_backward();
                }
              });
            }
          },
          release())
      .def_property_readonly("bytes_per_sync",
                             [](const PyDDP& r) { return r.ddp->bytes_per_sync(); })
      .def_property_readonly("num_buckets", [](const PyDDP& r) { return r.ddp->buckets().size(); })
      .def("bucket_params", [](const PyDDP& r) { return r.ddp->bucket_params(); });

  py::class_<dist::ZeroAdamW, optim::Optimizer>(m, "ZeroAdamW")
      .def(py::init([](const py::iterable& params, float lr, std::pair<float, float> betas,
                       float eps, float weight_decay, const py::object& reducer, int stage,
                       const std::string& offload_dir) {
             std::shared_ptr<dist::ProcessGroup> g = default_group();
             if (!g) g = dist::single_process_group();
             std::vector<std::vector<Tensor>> buckets;
             PyDDP* r = reducer.is_none() ? nullptr : &reducer.cast<PyDDP&>();
             if (r) buckets = r->ddp->bucket_params();
             if (stage == 2 && !r)
               throw py::value_error(
                   "ZeRO stage 2 shards DDP's gradient buckets: pass the DDP model");
             if (stage == 3 && (r == nullptr || r->gpt == nullptr))
               throw py::value_error(
                   "ZeRO stage 3 shards the parameters of a fully_shard model: pass it as ddp=");
             if (stage != 3 && r != nullptr && r->gpt != nullptr)
               throw py::value_error("a fully_shard model takes ZeRO stage 3");
             if (stage == 3 && r->sharded)
               throw py::value_error("this fully_shard model already has its stage-3 optimizer");
             std::optional<optim::OffloadOptions> off;
             if (!offload_dir.empty()) off = optim::OffloadOptions{offload_dir};
             auto* z = new dist::ZeroAdamW(param_groups(params, weight_decay),
                                           {lr, betas.first, betas.second, eps}, g,
                                           std::move(buckets), stage, int64_t{1} << 22, off);
             if (stage == 2) r->ddp->shard_gradients(z->gradient_shards());
             if (stage == 3) {  // every micro-batch reduce-scattered; the parameters into units
               r->ddp->shard_gradients(z->gradient_shards(), true);
               r->sharded =
                   std::make_shared<dist::ShardedParameters>(r->gpt->units(), *z, r->zero3, r->low);
               r->gpt->set_unit_hooks(r->sharded.get());
             }
             return z;
           }),
           py::arg("params"), py::arg("lr") = 1e-3f,
           py::arg("betas") = std::pair<float, float>(0.9f, 0.999f), py::arg("eps") = 1e-8f,
           py::arg("weight_decay") = 1e-2f, py::kw_only(), py::arg("reducer") = py::none(),
           py::arg("stage") = 1, py::arg("offload_dir") = "", py::keep_alive<1, 2>())
      .def_property_readonly("stage", &dist::ZeroAdamW::stage)
      .def_property_readonly("num_elements", &dist::ZeroAdamW::num_elements)
      .def_property_readonly("shard_size", &dist::ZeroAdamW::shard_size)
      .def_property_readonly("state_bytes", &dist::ZeroAdamW::state_bytes,
                             "bytes of Adam's moments this rank holds (2 x shard x 4)");

  py::module_ o = top.attr("optim").cast<py::module_>();
  py::class_<optim::OffloadedAdamW, optim::Optimizer>(o, "OffloadedAdamW")
      .def(py::init([](const py::iterable& params, const std::string& dir, float lr,
                       std::pair<float, float> betas, float eps, float weight_decay,
                       int64_t chunk_mb) {
             optim::OffloadOptions off{dir, chunk_mb << 20};
             return new optim::OffloadedAdamW(param_groups(params, weight_decay),
                                              {lr, betas.first, betas.second, eps}, off);
           }),
           py::arg("params"), py::arg("dir"), py::arg("lr") = 1e-3f,
           py::arg("betas") = std::pair<float, float>(0.9f, 0.999f), py::arg("eps") = 1e-8f,
           py::arg("weight_decay") = 1e-2f, py::arg("chunk_mb") = 64, py::keep_alive<1, 2>())
      .def_property_readonly("state_elements", &optim::OffloadedAdamW::state_elements)
      .def_property_readonly(
          "buffer_bytes", [](optim::OffloadedAdamW& a) { return a.moments().buffer_bytes(); },
          "the moments' bytes resident in memory (chunk buffers)")
      .def_property_readonly(
          "file_bytes", [](optim::OffloadedAdamW& a) { return a.moments().file_bytes(); },
          "the moments' bytes on disk");
}

}  // namespace kuai::python
