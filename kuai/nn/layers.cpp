// Linear, LayerNorm, RMSNorm and Embedding (see layers.h).
#include "kuai/nn/layers.h"

#include <cmath>
#include <set>

#include "kuai/core/ops.h"

namespace kuai::nn {

Linear::Linear(int64_t in, int64_t out, bool bias, Generator& gen) {
  // PyTorch's default: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
  const float bound = in > 0 ? 1.0f / std::sqrt(static_cast<float>(in)) : 0.0f;
  weight_ = register_parameter("weight", gen.uniform({out, in}, -bound, bound));
  if (bias) bias_ = register_parameter("bias", gen.uniform({out}, -bound, bound));
}

Tensor Linear::forward(const Tensor& x) const { return linear(x, weight_, bias_); }

LayerNorm::LayerNorm(int64_t features, float eps) : eps_(eps) {
  weight_ = register_parameter("weight", full({features}, 1.0f));
  bias_ = register_parameter("bias", zeros({features}));
}

Tensor LayerNorm::forward(const Tensor& x) const { return layer_norm(x, weight_, bias_, eps_); }

RMSNorm::RMSNorm(int64_t features, float eps) : eps_(eps) {
  weight_ = register_parameter("weight", full({features}, 1.0f));
}

Tensor RMSNorm::forward(const Tensor& x) const { return rms_norm(x, weight_, eps_); }

Embedding::Embedding(int64_t num, int64_t dim, Generator& gen) {
  weight_ = register_parameter("weight", gen.normal({num, dim}));
}

Tensor Embedding::forward(const Tensor& indices) const { return embedding(weight_, indices); }

std::vector<Tensor> product_parameters(Module& root) {
  std::set<const TensorImpl*> linear, other;
  for (auto& [name, m] : root.named_modules()) {
    const bool is_linear = dynamic_cast<Linear*>(m) != nullptr;
    for (auto& [pname, p] : m->named_parameters()) {
      if (pname.find('.') != std::string::npos) continue;  // a child's: counted at the child
      (is_linear ? linear : other).insert(p.impl());
    }
  }
  std::vector<Tensor> out;
  for (auto& [name, p] : root.named_parameters())
    if (linear.count(p.impl()) && !other.count(p.impl())) out.push_back(p);
  return out;
}

}  // namespace kuai::nn
