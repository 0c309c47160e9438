// The float64 oracle harness (see grad_check.h).
#include "grad_check.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kuai/core/autograd.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"

namespace kuai::test {

DT to_dt(const Tensor& t) {
  Tensor c = t.contiguous();
  DT d{c.shape(), std::vector<double>(c.numel())};
  std::vector<float> f(c.numel());
  if (c.dtype() == DType::kI32) {
    const int32_t* p = c.data<int32_t>();
    for (int64_t i = 0; i < c.numel(); ++i) d.v[i] = p[i];
    return d;
  }
  convert(c.raw_data(), c.dtype(), f.data(), DType::kF32, c.numel());
  for (int64_t i = 0; i < c.numel(); ++i) d.v[i] = f[i];
  return d;
}

Tensor rand_tensor(const Shape& shape, uint64_t seed, float scale) {
  Generator g(seed, 7);
  return g.uniform(shape, -scale, scale);
}

void check_op(const OpCase& c) {
  SCOPED_TRACE("op case: " + c.name);
  std::vector<Tensor> inputs;
  for (const Tensor& t : c.inputs) {
    Tensor x = t.detach();
    if (c.grad && is_floating(x.dtype())) x.requires_grad_(true);
    inputs.push_back(x);
  }
  std::vector<DT> ref_in;
  for (const Tensor& t : inputs) ref_in.push_back(to_dt(t));

  // Forward against the float64 reference.
  Tensor out = c.run(inputs);
  const DT ref_out = c.reference(ref_in);
  ASSERT_EQ(out.shape(), ref_out.shape) << "output shape";
  const DT got = to_dt(out);
  for (int64_t i = 0; i < got.numel(); ++i)
    ASSERT_NEAR(got.v[i], ref_out.v[i], c.forward_tol * (1.0 + std::fabs(ref_out.v[i])))
        << "forward element " << i;
  if (!c.grad) return;

  // Backward of sum(w * out) against central differences of the reference.
  Generator g(99, 3);
  Tensor w = g.uniform(out.shape(), -1.0f, 1.0f);
  const DT wd = to_dt(w);
  out.backward(w);
  auto objective = [&](const std::vector<DT>& in) {
    const DT y = c.reference(in);
    double s = 0;
    for (int64_t i = 0; i < y.numel(); ++i) s += y.v[i] * wd.v[i];
    return s;
  };
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!is_floating(inputs[k].dtype())) continue;
    SCOPED_TRACE("input " + std::to_string(k));
    ASSERT_TRUE(inputs[k].grad().defined()) << "no gradient reached input " << k;
    const DT grad = to_dt(inputs[k].grad());
    ASSERT_EQ(grad.shape, inputs[k].shape());
    std::vector<double> fd(grad.numel());
    double max_fd = 0;
    for (int64_t i = 0; i < grad.numel(); ++i) {
      std::vector<DT> plus = ref_in, minus = ref_in;
      const double h = 1e-6 * std::max(1.0, std::fabs(ref_in[k].v[i]));
      plus[k].v[i] += h;
      minus[k].v[i] -= h;
      fd[i] = (objective(plus) - objective(minus)) / (2 * h);
      max_fd = std::max(max_fd, std::fabs(fd[i]));
    }
    for (int64_t i = 0; i < grad.numel(); ++i)
      ASSERT_NEAR(grad.v[i], fd[i], c.grad_tol * (1.0 + max_fd)) << "gradient element " << i;
  }
}

}  // namespace kuai::test
