// Test support: a float64 oracle harness. An op case pairs a kuai op with a naive float64
// reference forward. check_op() compares the fp32 forward with the reference, then compares
// kuai's backward (vjp of sum(w * out) for a random cotangent w) against central finite
// differences of the float64 reference, input by input. Tolerances are given per case. Then the
// device axis (ggml's test-backend-ops): the case runs again on every other registered backend
// (the meta backend here) and must dispatch the same ops with the same shapes, dtypes and saved
// bytes, and the same gradient shapes, as on the CPU.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::test {

// A float64 tensor for references: shape + row-major values.
struct DT {
  Shape shape;
  std::vector<double> v;
  int64_t numel() const { return static_cast<int64_t>(v.size()); }
};

DT to_dt(const Tensor& t);  // any dtype -> double values (contiguous order)

struct OpCase {
  std::string name;
  std::vector<Tensor> inputs;
  std::function<Tensor(const std::vector<Tensor>&)> run;
  std::function<DT(const std::vector<DT>&)> reference;
  double forward_tol = 1e-5;  // |out - ref| <= tol * (1 + |ref|)
  double grad_tol = 1e-4;     // |grad - fd| <= tol * (1 + max|fd|)
  bool grad = true;
};

void check_op(const OpCase& c);

// Random float32 tensor in [-1, 1) (or scaled), deterministic per seed.
Tensor rand_tensor(const Shape& shape, uint64_t seed, float scale = 1.0f);

}  // namespace kuai::test
