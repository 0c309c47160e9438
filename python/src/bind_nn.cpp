// Modules in Python: kuai.nn.Module over kuai::nn::Module (subclassable: parameters and modules
// assigned to attributes are registered with the C++ module, in order, so named_parameters(),
// state_dict() and load_state_dict() are the engine's), the built-in layers, the GPT-2 and LLaMA
// blocks and models, flash attention's automatic replacement and activation recomputation.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <map>

#include "bindings.h"
#include "kuai/core/autograd.h"
#include "kuai/nn/checkpoint.h"
#include "kuai/nn/gpt.h"
#include "kuai/nn/layers.h"
#include "kuai/nn/llama.h"
#include "kuai/nn/optimize.h"

namespace kuai::python {

namespace {

using release = py::call_guard<py::gil_scoped_release>;
using nn::Module;
template <typename M>
using ModuleClass = py::class_<M, Module, std::shared_ptr<M>>;

py::object object_setattr() {
  return py::module_::import("builtins").attr("object").attr("__setattr__");
}

// PyTorch's rule, without a Parameter type: a leaf tensor that requires grad, assigned to a
// module attribute, is a parameter (kuai.nn.Parameter(t) makes one); other tensors are plain
// attributes (an activation kept for later is not a leaf).
bool is_parameter(const py::handle& value) {
  if (!py::isinstance<Tensor>(value)) return false;
  const Tensor& t = value.cast<const Tensor&>();
  return t.defined() && t.requires_grad() && t.is_leaf();
}

void module_setattr(py::object self, const std::string& name, py::object value) {
  Module& m = self.cast<Module&>();
  if (is_parameter(value)) {
    m.register_parameter(name, value.cast<Tensor>());
  } else if (py::isinstance<Module>(value)) {
    m.register_module(name, value.cast<std::shared_ptr<Module>>());
  } else {
    m.unregister(name);  // a parameter or module replaced by something else
  }
  object_setattr()(self, name, value);
}

py::list named_parameters(const Module& m) {
  py::list out;
  for (auto& [name, t] : m.named_parameters()) out.append(py::make_tuple(name, t));
  return out;
}

py::dict state_dict(const Module& m) {
  py::dict d;
  for (auto& [name, t] : m.state_dict()) d[py::str(name)] = t;
  return d;
}

void load_state_dict(Module& m, const py::dict& d) {
  std::map<std::string, Tensor> state;
  for (auto [k, v] : d) state.emplace(k.cast<std::string>(), v.cast<Tensor>());
  py::gil_scoped_release nogil;
  m.load_state_dict(state);
}

nn::GPTConfig make_config(const py::kwargs& kw) {
  nn::GPTConfig c;
  for (auto [k, v] : kw) {
    const auto key = k.cast<std::string>();
    if (key == "family")
      c.family = v.cast<std::string>();
    else if (key == "vocab_size")
      c.vocab_size = v.cast<int64_t>();
    else if (key == "n_layer")
      c.n_layer = v.cast<int64_t>();
    else if (key == "n_head")
      c.n_head = v.cast<int64_t>();
    else if (key == "d_model" || key == "n_embd")
      c.d_model = v.cast<int64_t>();
    else if (key == "seq_len" || key == "block_size")
      c.seq_len = v.cast<int64_t>();
    else if (key == "n_kv_head")
      c.n_kv_head = v.cast<int64_t>();
    else if (key == "ffn_hidden")
      c.ffn_hidden = v.cast<int64_t>();
    else if (key == "rope_theta")
      c.rope_theta = v.cast<double>();
    else if (key == "norm_eps")
      c.norm_eps = v.cast<double>();
    else if (key == "tie_embeddings")
      c.tie_embeddings = v.cast<bool>();
    else
      throw py::type_error("GPTConfig: unknown field '" + key +
                           "' (fields: family, vocab_size, n_layer, n_head, d_model, seq_len, "
                           "n_kv_head, ffn_hidden, rope_theta, norm_eps, tie_embeddings)");
  }
  return c;
}

py::object optional_tensor(const Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

}  // namespace

void bind_nn(py::module_& top) {
  py::module_ m = top.def_submodule("nn", "kuai::nn: modules, layers and models");

  py::class_<Module, std::shared_ptr<Module>>(m, "Module", py::dynamic_attr())
      .def(py::init<>())
      .def("__setattr__", &module_setattr)
      .def("__delattr__",
           [](py::object self, const std::string& name) {
             self.cast<Module&>().unregister(name);
             py::module_::import("builtins").attr("object").attr("__delattr__")(self, name);
           })
      .def("__call__", [](py::object self, py::args args,
                          py::kwargs kwargs) { return self.attr("forward")(*args, **kwargs); })
      .def("register_parameter", [](Module& self, const std::string& name,
                                    const Tensor& t) { self.register_parameter(name, t); })
      .def("register_module",
           [](Module& self, const std::string& name, std::shared_ptr<Module> child) {
             self.register_module(name, std::move(child));
           })
      .def("add_module",
           [](Module& self, const std::string& name, std::shared_ptr<Module> child) {
             self.register_module(name, std::move(child));
           })
      .def("named_parameters", &named_parameters)
      .def("parameters", &Module::parameters)
      .def("named_children",
           [](const Module& self) {
             py::list out;
             for (auto& [name, c] : self.named_children()) out.append(py::make_tuple(name, c));
             return out;
           })
      .def("children",
           [](const Module& self) {
             py::list out;
             for (auto& [name, c] : self.named_children()) out.append(c);
             return out;
           })
      .def("named_modules",
           [](Module& self) {
             py::list out;
             for (auto& [name, c] : self.named_modules())
               out.append(py::make_tuple(name, py::cast(c, py::return_value_policy::reference)));
             return out;
           })
      .def("get_submodule",
           [](Module& self, const std::string& target) -> py::object {
             for (auto& [name, c] : self.named_modules())
               if (name == target) return py::cast(c, py::return_value_policy::reference);
             throw py::attribute_error("no submodule '" + target + "'");
           })
      .def("num_parameters", &Module::num_parameters)
      .def("state_dict", &state_dict)
      .def("load_state_dict", &load_state_dict, py::arg("state_dict"))
      .def(
          "train",
          [](py::object self, bool on) {
            self.cast<Module&>().train(on);
            return self;
          },
          py::arg("mode") = true)
      .def("eval",
           [](py::object self) {
             self.cast<Module&>().eval();
             return self;
           })
      .def_property_readonly("training", &Module::is_training)
      .def(
          "zero_grad", [](Module& self, bool) { self.zero_grad(); }, py::arg("set_to_none") = true);

  ModuleClass<nn::Linear>(m, "Linear", py::dynamic_attr())
      .def(py::init([](int64_t in, int64_t out, bool bias, const py::object& gen) {
             return std::make_shared<nn::Linear>(in, out, bias, generator_or_default(gen));
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true, py::kw_only(),
           py::arg("generator") = py::none())
      .def("forward", &nn::Linear::forward, release())
      .def("__call__", &nn::Linear::forward, release())
      .def_property_readonly("weight", [](nn::Linear& l) { return l.weight(); })
      .def_property_readonly("bias", [](nn::Linear& l) { return optional_tensor(l.bias()); });
  ModuleClass<nn::LayerNorm>(m, "LayerNorm", py::dynamic_attr())
      .def(py::init<int64_t, float>(), py::arg("normalized_shape"), py::arg("eps") = 1e-5f)
      .def("forward", &nn::LayerNorm::forward, release())
      .def("__call__", &nn::LayerNorm::forward, release())
      .def_property_readonly("weight", [](nn::LayerNorm& l) { return l.weight(); })
      .def_property_readonly("bias", [](nn::LayerNorm& l) { return l.bias(); });
  ModuleClass<nn::RMSNorm>(m, "RMSNorm", py::dynamic_attr())
      .def(py::init<int64_t, float>(), py::arg("normalized_shape"), py::arg("eps") = 1e-5f)
      .def("forward", &nn::RMSNorm::forward, release())
      .def("__call__", &nn::RMSNorm::forward, release())
      .def_property_readonly("weight", [](nn::RMSNorm& l) { return l.weight(); });
  ModuleClass<nn::Embedding>(m, "Embedding", py::dynamic_attr())
      .def(py::init([](int64_t n, int64_t dim, const py::object& gen) {
             return std::make_shared<nn::Embedding>(n, dim, generator_or_default(gen));
           }),
           py::arg("num_embeddings"), py::arg("embedding_dim"), py::kw_only(),
           py::arg("generator") = py::none())
      .def("forward", &nn::Embedding::forward, release())
      .def("__call__", &nn::Embedding::forward, release())
      .def_property_readonly("weight", [](nn::Embedding& l) { return l.weight(); });

  py::class_<nn::GPTConfig>(m, "GPTConfig")
      .def(py::init(&make_config))
      .def_readwrite("family", &nn::GPTConfig::family)
      .def_readwrite("vocab_size", &nn::GPTConfig::vocab_size)
      .def_readwrite("n_layer", &nn::GPTConfig::n_layer)
      .def_readwrite("n_head", &nn::GPTConfig::n_head)
      .def_readwrite("d_model", &nn::GPTConfig::d_model)
      .def_readwrite("seq_len", &nn::GPTConfig::seq_len)
      .def_readwrite("n_kv_head", &nn::GPTConfig::n_kv_head)
      .def_readwrite("ffn_hidden", &nn::GPTConfig::ffn_hidden)
      .def_readwrite("rope_theta", &nn::GPTConfig::rope_theta)
      .def_readwrite("norm_eps", &nn::GPTConfig::norm_eps)
      .def_readwrite("tie_embeddings", &nn::GPTConfig::tie_embeddings)
      .def("resolved", &nn::GPTConfig::resolved)
      .def("validate", &nn::GPTConfig::validate)
      .def("__eq__", [](const nn::GPTConfig& a, const nn::GPTConfig& b) { return a == b; })
      .def("__repr__", [](const nn::GPTConfig& c) { return "GPTConfig(" + nn::describe(c) + ")"; });

  // Attention modules: `impl` is "naive" | "flash" | "auto" (what kuai.optimize switches).
  py::class_<nn::AttentionModule, Module, std::shared_ptr<nn::AttentionModule>>(
      m, "AttentionModule", py::dynamic_attr())
      .def_property(
          "impl", [](const nn::AttentionModule& a) { return nn::attention_impl_name(a.impl()); },
          [](nn::AttentionModule& a, const std::string& s) {
            a.set_impl(nn::parse_attention_impl(s));
          });
  py::class_<nn::CausalSelfAttention, nn::AttentionModule,
             std::shared_ptr<nn::CausalSelfAttention>>(m, "CausalSelfAttention", py::dynamic_attr())
      .def(py::init([](int64_t d_model, int64_t n_head, const py::object& gen) {
             return std::make_shared<nn::CausalSelfAttention>(d_model, n_head,
                                                              generator_or_default(gen));
           }),
           py::arg("d_model"), py::arg("n_head"), py::kw_only(), py::arg("generator") = py::none())
      .def("forward", &nn::CausalSelfAttention::forward, release())
      .def("__call__", &nn::CausalSelfAttention::forward, release());
  py::class_<nn::LlamaAttention, nn::AttentionModule, std::shared_ptr<nn::LlamaAttention>>(
      m, "LlamaAttention", py::dynamic_attr())
      .def(py::init([](const nn::GPTConfig& cfg, const py::object& gen) {
             return std::make_shared<nn::LlamaAttention>(cfg.resolved(), generator_or_default(gen));
           }),
           py::arg("config"), py::kw_only(), py::arg("generator") = py::none())
      .def("forward", &nn::LlamaAttention::forward, release())
      .def("__call__", &nn::LlamaAttention::forward, release());
  ModuleClass<nn::MLP>(m, "MLP", py::dynamic_attr())
      .def(py::init([](int64_t d_model, const py::object& gen) {
             return std::make_shared<nn::MLP>(d_model, generator_or_default(gen));
           }),
           py::arg("d_model"), py::kw_only(), py::arg("generator") = py::none())
      .def("forward", &nn::MLP::forward, release())
      .def("__call__", &nn::MLP::forward, release());
  ModuleClass<nn::LlamaMLP>(m, "SwiGLU", py::dynamic_attr())
      .def(py::init([](int64_t d_model, int64_t hidden, const py::object& gen) {
             return std::make_shared<nn::LlamaMLP>(d_model, hidden, generator_or_default(gen));
           }),
           py::arg("d_model"), py::arg("hidden"), py::kw_only(), py::arg("generator") = py::none())
      .def("forward", &nn::LlamaMLP::forward, release())
      .def("__call__", &nn::LlamaMLP::forward, release());
  py::class_<nn::DecoderBlock, Module, std::shared_ptr<nn::DecoderBlock>>(m, "DecoderBlock",
                                                                          py::dynamic_attr())
      .def("forward", &nn::DecoderBlock::forward, release())
      .def("__call__", &nn::DecoderBlock::forward, release());
  py::class_<nn::Block, nn::DecoderBlock, std::shared_ptr<nn::Block>>(m, "Block",
                                                                      py::dynamic_attr())
      .def(py::init([](const nn::GPTConfig& cfg, const py::object& gen) {
             return std::make_shared<nn::Block>(cfg.resolved(), generator_or_default(gen));
           }),
           py::arg("config"), py::kw_only(), py::arg("generator") = py::none());
  py::class_<nn::LlamaBlock, nn::DecoderBlock, std::shared_ptr<nn::LlamaBlock>>(m, "LlamaBlock",
                                                                                py::dynamic_attr())
      .def(py::init([](const nn::GPTConfig& cfg, const py::object& gen) {
             return std::make_shared<nn::LlamaBlock>(cfg.resolved(), generator_or_default(gen));
           }),
           py::arg("config"), py::kw_only(), py::arg("generator") = py::none());

  ModuleClass<nn::GPT>(m, "GPT", py::dynamic_attr())
      .def(py::init<const nn::GPTConfig&, uint64_t>(), py::arg("config"), py::arg("seed") = 0)
      .def("forward", &nn::GPT::forward, release())
      .def(
          "__call__",
          [](const nn::GPT& g, const Tensor& idx, const std::optional<Tensor>& targets) {
            return targets ? g.loss(idx, *targets) : g.forward(idx);
          },
          py::arg("idx"), py::arg("targets") = py::none(), release())
      .def(
          "loss",
          [](const nn::GPT& g, const Tensor& idx, const Tensor& targets, int32_t ignore_index) {
            return g.loss(idx, targets, ignore_index);
          },
          py::arg("idx"), py::arg("targets"), py::arg("ignore_index") = -100, release())
      .def_property_readonly("config", &nn::GPT::config)
      .def("num_matmul_parameters", &nn::GPT::num_matmul_parameters)
      .def(
          "set_recompute",
          [](nn::GPT& g, const std::string& policy, int64_t layers) {
            g.set_recompute(nn::parse_recompute(policy), layers);
          },
          py::arg("policy"), py::arg("layers") = -1)
      .def_property_readonly("recompute",
                             [](const nn::GPT& g) { return nn::recompute_name(g.recompute()); });

  // kuai.optimize(model, to="flash"): the automatic replacement of attention.
  top.def(
      "optimize",
      [](Module& model, const std::string& to) {
        py::list out;
        for (const Replaced& r : optimize(model, nn::parse_attention_impl(to)))
          out.append(py::make_tuple(r.module, r.from, r.to));
        return out;
      },
      py::arg("model"), py::arg("attention") = "flash");

  // Activation recomputation of a region: fn(*inputs) -> a tensor or a list of tensors.
  m.def(
      "checkpoint",
      [](py::function fn, const std::vector<Tensor>& inputs, const std::string& policy) {
        bool single = false;
        nn::CheckpointFn cfn = [&](const std::vector<Tensor>& in) {
          py::gil_scoped_acquire gil;
          py::tuple args(in.size());
          for (size_t i = 0; i < in.size(); ++i) args[i] = in[i];
          py::object r = fn(*args);
          if (py::isinstance<Tensor>(r)) {
            single = true;
            return std::vector<Tensor>{r.cast<Tensor>()};
          }
          return r.cast<std::vector<Tensor>>();
        };
        std::vector<Tensor> out;
        {
          py::gil_scoped_release nogil;
          out = nn::checkpoint(cfn, inputs, nn::parse_recompute(policy));
        }
        return single ? py::cast(out[0]) : py::cast(out);
      },
      py::arg("function"), py::arg("inputs"), py::arg("policy") = "full");
  m.def("recompute_stats", [] {
    const nn::RecomputeStats s = nn::recompute_stats();
    py::dict d;
    d["regions"] = s.regions;
    d["dropped_bytes"] = s.dropped_bytes;
    d["kept_bytes"] = s.kept_bytes;
    d["replays"] = s.replays;
    d["replayed_ops"] = s.replayed_ops;
    return d;
  });
  m.def("reset_recompute_stats", &nn::reset_recompute_stats);
}

}  // namespace kuai::python
