// Module registration, traversal and state-dict loading.
#include "kuai/nn/module.h"

#include <fmt/format.h>

#include <cstring>
#include <set>
#include <stdexcept>

namespace kuai::nn {

Tensor& Module::register_parameter(const std::string& name, Tensor t) {
  t.requires_grad_(true);
  for (auto& [n, p] : params_)
    if (n == name) {
      p = std::move(t);
      return p;
    }
  params_.emplace_back(name, std::move(t));
  return params_.back().second;
}

void Module::unregister(const std::string& name) {
  std::erase_if(params_, [&](const auto& e) { return e.first == name; });
  std::erase_if(children_, [&](const auto& e) { return e.first == name; });
}

void Module::collect(const std::string& prefix,
                     std::vector<std::pair<std::string, Tensor>>& out) const {
  for (const auto& [name, t] : params_) out.emplace_back(prefix + name, t);
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", out);
}

std::vector<std::pair<std::string, Tensor>> Module::named_parameters() const {
  std::vector<std::pair<std::string, Tensor>> all, out;
  collect("", all);
  std::set<const TensorImpl*> seen;
  for (auto& [name, t] : all)
    if (seen.insert(t.impl()).second) out.emplace_back(std::move(name), std::move(t));
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() {
  std::vector<std::pair<std::string, Module*>> out{{"", this}};
  for (auto& [name, child] : children_)
    for (auto& [sub, m] : child->named_modules())
      out.emplace_back(sub.empty() ? name : name + "." + sub, m);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const Tensor& t : parameters()) n += t.numel();
  return n;
}

void Module::load_state_dict(const std::map<std::string, Tensor>& state) {
  auto params = named_parameters();
  std::set<std::string> known;
  for (auto& [name, p] : params) {
    known.insert(name);
    auto it = state.find(name);
    if (it == state.end())
      throw std::invalid_argument(fmt::format("load_state_dict: missing key '{}'", name));
    const Tensor& src = it->second;
    if (src.shape() != p.shape() || src.dtype() != p.dtype())
      throw std::invalid_argument(fmt::format("load_state_dict: '{}' is {} but the model has {}",
                                              name, src.str(), p.str()));
    p.copy_(src);
  }
  for (const auto& [name, t] : state)
    if (!known.count(name))
      throw std::invalid_argument(fmt::format("load_state_dict: unexpected key '{}'", name));
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

void Module::zero_grad() {
  for (Tensor& t : parameters()) t.set_grad(Tensor());
}

}  // namespace kuai::nn
