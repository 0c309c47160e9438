// Module: the base of every layer. Parameters and child modules are registered by name, in
// order, so named_parameters() and state_dict() list them deterministically ("h.0.attn.c_attn.
// weight", ...). A tensor registered twice (tied weights) is listed once, at its first name.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::nn {

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  std::vector<std::pair<std::string, Tensor>> named_parameters() const;
  std::vector<Tensor> parameters() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const {
    return children_;
  }
  // All modules below this one (depth first), with their dotted names; "" is this module.
  std::vector<std::pair<std::string, Module*>> named_modules();
  int64_t num_parameters() const;

  // name -> tensor (the parameters themselves, sharing storage).
  std::vector<std::pair<std::string, Tensor>> state_dict() const { return named_parameters(); }
  // Copies values in; every parameter must be present with the same shape and dtype (strict),
  // unknown names are an error too. Messages name the offending key.
  void load_state_dict(const std::map<std::string, Tensor>& state);

  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  void zero_grad();  // sets every parameter's .grad to none

  // Registration (public, as PyTorch's register_parameter and register_module: what a module
  // defined in Python calls when a parameter or module is assigned to one of its attributes).
  // The parameter is made to require grad. Registering a name again replaces the entry in place
  // (its position in the order is kept).
  Tensor& register_parameter(const std::string& name, Tensor t);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    for (auto& [n, child] : children_)
      if (n == name) {
        child = m;
        return m;
      }
    children_.emplace_back(name, m);
    return m;
  }
  // Removes a parameter or child module of this name, if there is one (a Python attribute
  // assigned something else, or deleted).
  void unregister(const std::string& name);

 private:
  void collect(const std::string& prefix, std::vector<std::pair<std::string, Tensor>>& out) const;
  std::vector<std::pair<std::string, Tensor>> params_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

}  // namespace kuai::nn
