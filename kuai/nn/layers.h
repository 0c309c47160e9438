// The basic layers: Linear, LayerNorm, RMSNorm, Embedding. PyTorch's parameter names and layouts
// (Linear.weight is (out, in)) and default initialisations, drawn from a kuai Generator.
#pragma once

#include "kuai/core/rng.h"
#include "kuai/nn/module.h"

namespace kuai::nn {

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, Generator& gen);
  Tensor forward(const Tensor& x) const;  // (..., in) -> (..., out)
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }

 private:
  Tensor weight_, bias_;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t features, float eps = 1e-5f);
  Tensor forward(const Tensor& x) const;
  Tensor& weight() { return weight_; }
  Tensor& bias() { return bias_; }

 private:
  Tensor weight_, bias_;
  float eps_;
};

// RMSNorm over the last axis, weight initialised to 1 (LLaMA's norm; no bias).
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t features, float eps = 1e-5f);
  Tensor forward(const Tensor& x) const;
  Tensor& weight() { return weight_; }

 private:
  Tensor weight_;
  float eps_;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator& gen);
  Tensor forward(const Tensor& indices) const;  // int32 (...) -> (..., dim)
  Tensor& weight() { return weight_; }

 private:
  Tensor weight_;
};

// The parameters that only products read: those of the nn::Linear modules under `root` that no
// other module also holds (a head tied to an embedding is left out), in named_parameters() order.
// Under autocast these are read only through their low-precision casts, so they may be kept in
// the compute dtype with their fp32 masters elsewhere (train.offload_master).
std::vector<Tensor> product_parameters(Module& root);

}  // namespace kuai::nn
