// The float64 oracle harness (see grad_check.h).
#include "grad_check.h"

#include <gtest/gtest.h>

#include <cmath>

#include "kuai/backend/cpu/convert.h"
#include "kuai/core/autograd.h"
#include "kuai/core/backend.h"
#include "kuai/core/dispatch.h"
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

namespace {

// Every op a case dispatches, as "name dtype(shape)... saves N": the primitive, its outputs, and
// the bytes its autograd node keeps (the inputs and outputs it says it saves) when recorded.
class OpLog final : public DispatchMode {
 public:
  bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override {
    std::string e(p.name());
    for (const Tensor& t : out) {
      e += ' ';
      e += dtype_name(t.dtype());
      e += shape_str(t.shape());
    }
    bool recorded = autograd::GradMode::enabled() && !p.updates_in_place();
    bool any_grad = false;
    for (const Tensor& t : in) any_grad = any_grad || t.requires_grad();
    if (recorded && any_grad && !p.is_view()) {
      int64_t saved = 0;
      for (size_t i = 0; i < in.size(); ++i)
        if (p.saves_input(i)) saved += in[i].nbytes();
      for (size_t j = 0; j < out.size(); ++j)
        if (p.saves_output(j)) saved += out[j].nbytes();
      e += " saves " + std::to_string(saved);
    }
    for (const Tensor& t : out)
      if (t.device() != device) e += " on " + t.device().str() + "!";
    entries.push_back(std::move(e));
    return false;
  }
  Device device = kCPU;
  std::vector<std::string> entries;
};

struct DeviceRun {
  std::vector<std::string> ops;    // forward and backward, in dispatch order
  std::vector<std::string> grads;  // per input: dtype and shape of its gradient, or "-"
  Tensor out;
};

// The case on `device`: inputs moved there, forward, then backward of sum(w * out).
DeviceRun run_on(const OpCase& c, Device device) {
  DeviceRun r;
  OpLog log;
  log.device = device;
  std::vector<Tensor> inputs;
  for (const Tensor& t : c.inputs) {
    Tensor x = t.detach().to(device);
    if (c.grad && is_floating(x.dtype())) x.requires_grad_(true);
    inputs.push_back(x);
  }
  {
    ModeGuard guard(log);
    r.out = c.run(inputs);
    if (c.grad) {
      Generator g(99, 3);
      r.out.backward(g.uniform(r.out.shape(), -1.0f, 1.0f, device));
    }
  }
  for (const Tensor& x : inputs)
    r.grads.push_back(
        x.requires_grad() && x.grad().defined()
            ? std::string(dtype_name(x.grad().dtype())) + shape_str(x.grad().shape()) +
                  (x.grad().device() == device ? "" : " on " + x.grad().device().str())
            : "-");
  r.ops = std::move(log.entries);
  return r;
}

// The device axis: every registered backend besides the CPU runs the case. Each must dispatch
// the same ops with the same output shapes and dtypes, save the same bytes for backward, and give
// every input a gradient of the same shape and dtype, all on its own device; a backend with bytes
// must also match the CPU's forward values within the case's tolerance.
void check_devices(const OpCase& c) {
  const DeviceRun cpu = run_on(c, kCPU);
  for (size_t t = 0; t < kDeviceTypes; ++t) {
    const auto type = static_cast<DeviceType>(t);
    if (type == DeviceType::kCPU || !backend_available(type)) continue;
    const Device device{type, 0};
    SCOPED_TRACE("device " + device.str());
    const DeviceRun other = run_on(c, device);
    EXPECT_EQ(other.out.device(), device);
    EXPECT_EQ(other.ops, cpu.ops);
    EXPECT_EQ(other.grads, cpu.grads);
    if (!backend_for(device).has_bytes()) continue;
    const DT a = to_dt(cpu.out), b = to_dt(other.out.to(kCPU));
    for (int64_t i = 0; i < a.numel(); ++i)
      ASSERT_NEAR(b.v[i], a.v[i], c.forward_tol * (1.0 + std::fabs(a.v[i]))) << "element " << i;
  }
}

}  // namespace

void check_op(const OpCase& c) {
  SCOPED_TRACE("op case: " + c.name);
  check_devices(c);
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
    // The elements' differences are independent: the test's threads share them (each with its
    // own perturbed copies of the inputs, restored after each element), the values the same as
    // one thread's.
    std::vector<double> fd(grad.numel());
    std::string error;
#pragma omp parallel
    {
      std::vector<DT> plus = ref_in, minus = ref_in;
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < grad.numel(); ++i) {
        const double x = ref_in[k].v[i];
        const double h = 1e-6 * std::max(1.0, std::fabs(x));
        plus[k].v[i] = x + h;
        minus[k].v[i] = x - h;
        try {
          fd[i] = (objective(plus) - objective(minus)) / (2 * h);
        } catch (const std::exception& e) {
#pragma omp critical(kuai_grad_check_error)
          error = e.what();
        }
        plus[k].v[i] = x;
        minus[k].v[i] = x;
      }
    }
    ASSERT_TRUE(error.empty()) << "the reference threw: " << error;
    double max_fd = 0;
    for (int64_t i = 0; i < grad.numel(); ++i) max_fd = std::max(max_fd, std::fabs(fd[i]));
    for (int64_t i = 0; i < grad.numel(); ++i)
      ASSERT_NEAR(grad.v[i], fd[i], c.grad_tol * (1.0 + max_fd)) << "gradient element " << i;
  }
}

}  // namespace kuai::test
