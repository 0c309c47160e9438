// kuai.plan on a model built in Python: the planner (kuai::plan) traces the real training step of
// whatever model_fn builds, on meta tensors (no byte computed), with AdamW (or ZeRO's sharded
// AdamW), DDP's buckets on `ranks` ranks, autocast and accumulation, and prices it at this
// machine's measured costs: the same prediction `kuai plan` makes for a config, for any model
// made of kuai's modules and ops.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <iterator>

#include "bindings.h"
#include "kuai/amp/autocast.h"
#include "kuai/nn/gpt.h"
#include "kuai/plan/disk.h"
#include "kuai/plan/plan.h"
#include "kuai/train/step_parts.h"

namespace kuai::python {

void bind_plan(py::module_& top) {
  top.def(
      "plan",
      [](py::function model_fn, int64_t batch_size, int64_t seq_len, int64_t accumulation_steps,
         const std::string& precision, int64_t ranks, int zero, double weight_decay,
         const std::string& memory, const std::string& compression, bool quick) {
        if (batch_size < 1 || seq_len < 1 || accumulation_steps < 1 || ranks < 1)
          throw py::value_error(
              "kuai.plan: batch_size, seq_len, accumulation_steps and ranks "
              "must be at least 1");
        if (zero < 0 || zero > 2)
          throw py::value_error("kuai.plan: zero must be 0, 1 or 2, got " + std::to_string(zero));
        train::StepOptions so;
        so.accum_steps = accumulation_steps;
        so.compute = amp::precision_dtype(precision);
        std::vector<py::object> keep;  // the Python models the trace built (freed after it)
        plan::TraceTarget target;
        target.batch = batch_size;
        target.seq = seq_len;
        target.accum = accumulation_steps;
        target.world = static_cast<int>(ranks);
        target.build = [&](std::shared_ptr<dist::ProcessGroup> group) {
          auto parts = std::make_unique<train::StepParts>();
          py::object obj;
          {
            const MemoryUseScope params(MemoryUse::kParameters);
            obj = model_fn();
          }
          if (!py::isinstance<nn::Module>(obj))
            throw py::type_error("kuai.plan: model_fn() must return a kuai.nn.Module");
          keep.push_back(obj);
          parts->model = obj.cast<std::shared_ptr<nn::Module>>();
          nn::Module& m = *parts->model;
          const auto groups = train::param_groups(m, static_cast<float>(weight_decay));
          if (group->size() > 1) {
            dist::DDPOptions d;
            d.compression = dist::parse_compression(compression);
            parts->ddp.emplace(m, group, d);
          }
          if (zero > 0)
            parts->zero = std::make_unique<dist::ZeroAdamW>(
                groups, optim::AdamWOptions{}, group,
                parts->ddp ? parts->ddp->bucket_params() : std::vector<std::vector<Tensor>>{},
                parts->ddp ? zero : 1);
          else
            parts->adamw = std::make_unique<optim::AdamW>(groups, optim::AdamWOptions{});
          if (parts->zero && parts->zero->stage() == 2)
            parts->ddp->shard_gradients(parts->zero->gradient_shards());
          amp::GradScalerOptions sc;
          sc.enabled = so.compute == DType::kF16;
          parts->scaler = std::make_unique<amp::GradScaler>(sc);
          train::TrainStep::LossFn loss;
          if (auto* gpt = dynamic_cast<nn::GPT*>(&m)) {
            loss = [gpt](const Tensor& x, const Tensor& y) { return gpt->loss(x, y); };
          } else {
            loss = [obj](const Tensor& x, const Tensor& y) {
              py::gil_scoped_acquire gil;
              return obj(x, y).cast<Tensor>();
            };
          }
          parts->step = std::make_unique<train::TrainStep>(
              m, std::move(loss), parts->optimizer(), *parts->scaler, so,
              parts->ddp ? &*parts->ddp : nullptr, parts->zero.get());
          return parts;
        };

        plan::StepSpec spec;
        spec.batch = batch_size;
        spec.seq = seq_len;
        spec.accum = accumulation_steps;
        spec.compute = so.compute;
        spec.ranks = ranks;
        spec.zero = zero;
        spec.compression = compression;
        spec.threads = omp_get_max_threads();
        const plan::Link link = plan::measured_or_assumed_link();
        plan::MachineCosts costs;
        if (const auto d = plan::measured_disk()) costs.disk = *d;
        const int64_t budget =
            memory.empty() ? plan::machine_memory_bytes() : plan::parse_bytes(memory, "memory");
        plan::set_quick_measurements(quick);
        plan::Prediction p;
        try {
          p = plan::predict_target(target, spec, budget, link, costs);
        } catch (...) {
          plan::set_quick_measurements(false);
          throw;
        }
        plan::set_quick_measurements(false);
        keep.clear();

        py::dict out;
        out["peak_bytes"] = p.step.peak_bytes;
        out["fits"] = p.fits();
        out["budget_bytes"] = p.budget_bytes;
        out["peak_where"] = p.step.peak_where;
        py::dict at_peak, persistent;
        // Short keys in MemoryUse's order (memory_use_name() says each in words).
        static const char* const kKeys[] = {
            "other",       "parameters",       "gradients", "optimizer", "weight_casts",
            "activations", "activation_grads", "comm",      "workspace", "data",
            "arena",       "captured"};
        static_assert(std::size(kKeys) == static_cast<size_t>(MemoryUse::kCount));
        for (int u = 0; u < static_cast<int>(MemoryUse::kCount); ++u) {
          const char* name = kKeys[u];
          at_peak[name] = p.step.at_peak[static_cast<size_t>(u)];
          persistent[name] = p.step.persistent[static_cast<size_t>(u)];
        }
        out["at_peak"] = at_peak;
        out["persistent"] = persistent;
        out["saved_bytes"] = p.step.saved_total;
        out["step_s"] = p.time.step_s;
        out["tokens_per_s"] = p.time.tokens_per_s;
        out["flops"] = p.time.flops;
        out["products_s"] = p.time.products_s;
        out["attention_s"] = p.time.attention_s;
        out["memory_s"] = p.time.memory_s;
        out["comm_s"] = p.time.comm_s;
        out["comm_exposed_s"] = p.time.comm_exposed_s;
        out["ops"] = p.step.ops.size();
        out["result"] = plan::result_line(p);
        return out;
      },
      py::arg("model_fn"), py::kw_only(), py::arg("batch_size"), py::arg("seq_len"),
      py::arg("accumulation_steps") = 1, py::arg("precision") = "fp32", py::arg("ranks") = 1,
      py::arg("zero") = 0, py::arg("weight_decay") = 0.1, py::arg("memory") = "",
      py::arg("compression") = "none", py::arg("quick") = false,
      "Predicts the peak memory per rank and the step time of training model_fn()'s model "
      "(built on meta inside: no byte computed) with AdamW: the planner of `kuai plan`. "
      "Returns a dict (peak_bytes, at_peak by use, step_s, tokens_per_s, fits, result, ...).");
}

}  // namespace kuai::python
