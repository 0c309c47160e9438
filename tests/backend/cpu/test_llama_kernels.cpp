// The kernels the LLaMA family and the compiled step's fusions added, each against its naive
// reference in reference.h (double math, no threads): RMSNorm forward and backward, rotary
// embedding (forward, inverse, heads past rotated_heads copied, a KV cache's pos0), SiLU and
// SwiGLU forward and backward on fp32, add + LayerNorm, and GELU's backward with its bias sum.
// Odd shapes (not multiples of the vector width, one row). Tolerance: |kernel - ref| <=
// tol * (1 + |ref|), tol 4e-6 for elementwise math (fp32 exp and tanh, a few ulp) and 2e-5 where
// a row of C terms is summed in fp32 (RMSNorm's backward, the bias sum over n rows).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../../support/random.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu {
namespace {

using test::uniform;

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - want[i]) / (1.0 + std::fabs(want[i]));
    worst = std::max(worst, err);
    ASSERT_LE(err, tol) << what << " element " << i << ": " << got[i] << " vs " << want[i];
  }
  testing::Test::RecordProperty(what, std::to_string(worst));
}

TEST(LlamaKernels, RmsNormForwardAndBackwardMatchTheReference) {
  for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {5, 64}, {7, 301}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << C);
    const auto x = uniform(N * C, -2.0f, 2.0f, 1), w = uniform(C, 0.5f, 1.5f, 2);
    const auto dy = uniform(N * C, -1.0f, 1.0f, 3);
    std::vector<float> y(N * C), r(N), y_ref(N * C), r_ref(N);
    rms_norm_forward(x.data(), w.data(), y.data(), r.data(), N, C, 1e-5f);
    ref::rms_norm_forward(x.data(), w.data(), y_ref.data(), r_ref.data(), N, C, 1e-5f);
    expect_close(y, y_ref, 4e-6, "rms_norm y");
    expect_close(r, r_ref, 4e-6, "rms_norm rstd");
    std::vector<float> dx(N * C), dw(C), dx_ref(N * C), dw_ref(C);
    rms_norm_backward(dy.data(), x.data(), w.data(), r.data(), dx.data(), dw.data(), N, C);
    ref::rms_norm_backward(dy.data(), x.data(), w.data(), r.data(), dx_ref.data(), dw_ref.data(), N,
                           C);
    expect_close(dx, dx_ref, 2e-5, "rms_norm dx");
    expect_close(dw, dw_ref, 2e-5, "rms_norm dw");
  }
}

TEST(LlamaKernels, RopeMatchesTheReference) {
  struct Case {
    int64_t B, T, heads, d, rotated, pos0;
    bool inverse;
  };
  for (const Case c :
       {Case{1, 1, 1, 2, 1, 0, false}, Case{2, 5, 3, 8, 3, 0, false}, Case{1, 7, 4, 6, 2, 0, true},
        Case{2, 3, 2, 16, 2, 7000, false}, Case{1, 4, 3, 10, 1, 33, true}}) {
    SCOPED_TRACE(testing::Message()
                 << c.B << "x" << c.T << "x" << c.heads << "x" << c.d << " rotated " << c.rotated
                 << " pos0 " << c.pos0 << (c.inverse ? " inverse" : ""));
    const int64_t n = c.B * c.T * c.heads * c.d;
    const auto x = uniform(n, -1.0f, 1.0f, 9);
    std::vector<float> y(n), y_ref(n);
    RopeArgs a{
        x.data(), c.T * c.heads * c.d, c.heads * c.d, c.d,     y.data(),  c.B,        c.T, c.heads,
        c.d,      c.rotated,           c.pos0,        10000.0, c.inverse, DType::kF32};
    rope(a);
    ref::rope(x.data(), y_ref.data(), c.B, c.T, c.heads, c.d, c.rotated, c.pos0, 10000.0,
              c.inverse);
    expect_close(y, y_ref, 4e-6, "rope");
  }
}

TEST(LlamaKernels, SiluAndSwigluMatchTheReference) {
  for (int64_t n : {1, 7, 16, 1000, 4099}) {
    SCOPED_TRACE(n);
    const auto x = uniform(n, -8.0f, 8.0f, 4), dy = uniform(n, -1.0f, 1.0f, 5);
    std::vector<float> y(n), y_ref(n), dx(n), dx_ref(n);
    silu_forward(x.data(), y.data(), n, DType::kF32);
    ref::silu_forward(x.data(), y_ref.data(), n);
    expect_close(y, y_ref, 4e-6, "silu");
    silu_backward(x.data(), dy.data(), dx.data(), n, DType::kF32);
    ref::silu_backward(x.data(), dy.data(), dx_ref.data(), n);
    expect_close(dx, dx_ref, 4e-6, "silu backward");
  }
  for (auto [rows, F] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {4, 64}, {2, 333}}) {
    SCOPED_TRACE(testing::Message() << rows << "x" << F);
    const auto h = uniform(rows * 2 * F, -6.0f, 6.0f, 6), dy = uniform(rows * F, -1.0f, 1.0f, 7);
    std::vector<float> y(rows * F), y_ref(rows * F), dh(rows * 2 * F), dh_ref(rows * 2 * F);
    swiglu_forward(h.data(), y.data(), rows, F, DType::kF32);
    ref::swiglu_forward(h.data(), y_ref.data(), rows, F);
    expect_close(y, y_ref, 4e-6, "swiglu");
    swiglu_backward(h.data(), dy.data(), dh.data(), rows, F, DType::kF32);
    ref::swiglu_backward(h.data(), dy.data(), dh_ref.data(), rows, F);
    expect_close(dh, dh_ref, 4e-6, "swiglu backward");
  }
}

TEST(LlamaKernels, AddLayerNormAndGeluBackwardSumMatchTheReference) {
  for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 1}, {3, 17}, {9, 128}, {5, 257}}) {
    SCOPED_TRACE(testing::Message() << N << "x" << C);
    const auto a = uniform(N * C, -1.0f, 1.0f, 11), b = uniform(N * C, -1.0f, 1.0f, 12);
    const auto w = uniform(C, 0.5f, 1.5f, 13), bias = uniform(C, -0.5f, 0.5f, 14);
    std::vector<float> x(N * C), y(N * C), m(N), r(N), x_ref(N * C), y_ref(N * C), m_ref(N),
        r_ref(N);
    add_layer_norm_forward(a.data(), b.data(), DType::kF32, x.data(), w.data(), bias.data(),
                           y.data(), m.data(), r.data(), N, C, 1e-5f);
    ref::add_layer_norm_forward(a.data(), b.data(), x_ref.data(), w.data(), bias.data(),
                                y_ref.data(), m_ref.data(), r_ref.data(), N, C, 1e-5f);
    expect_close(x, x_ref, 0.0, "add_layer_norm x");  // one fp32 add each: exact
    expect_close(y, y_ref, 2e-5, "add_layer_norm y");
    expect_close(r, r_ref, 2e-5, "add_layer_norm rstd");

    const auto dy = uniform(N * C, -1.0f, 1.0f, 15);
    std::vector<float> dx(N * C), db(C), dx_ref(N * C), db_ref(C);
    gelu_backward_sum(a.data(), dy.data(), dx.data(), db.data(), N, C);
    ref::gelu_backward_sum(a.data(), dy.data(), dx_ref.data(), db_ref.data(), N, C);
    expect_close(dx, dx_ref, 4e-6, "gelu_backward_sum dx");
    expect_close(db, db_ref, 2e-5, "gelu_backward_sum db");
  }
}

}  // namespace
}  // namespace kuai::cpu
