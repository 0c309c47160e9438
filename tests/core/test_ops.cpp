// Every primitive against a float64 reference, forward and backward (finite differences of the
// reference), at several shapes including odd ones. Tolerances: fp32 forward vs float64 is held
// to 1e-5 relative (a few ulp over short reductions; 2e-5 for long dot products), fp32
// gradients vs float64 central differences to 1e-4 of the gradient's scale (the differences
// themselves are accurate to ~1e-9; the slack is fp32 accumulation in the backward kernels).
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "../support/grad_check.h"
#include "kuai/backend/cpu/block_products.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"

namespace kuai::test {
namespace {

int64_t numel(const Shape& s) { return shape_numel(s); }

// Index helpers for broadcasting references.
std::vector<int64_t> unravel(int64_t i, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (int64_t k = static_cast<int64_t>(s.size()) - 1; k >= 0; --k) {
    idx[k] = i % s[k];
    i /= s[k];
  }
  return idx;
}
int64_t ravel_broadcast(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t o = 0;
  const size_t lead = idx.size() - s.size();
  for (size_t k = 0; k < s.size(); ++k) o = o * s[k] + (s[k] == 1 ? 0 : idx[lead + k]);
  return o;
}
Shape bshape(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    out[i] = std::max(da, db);
  }
  return out;
}

template <typename F>
std::function<DT(const std::vector<DT>&)> binary_ref(F f) {
  return [f](const std::vector<DT>& in) {
    DT y{bshape(in[0].shape, in[1].shape), {}};
    y.v.resize(numel(y.shape));
    for (int64_t i = 0; i < y.numel(); ++i) {
      auto idx = unravel(i, y.shape);
      y.v[i] =
          f(in[0].v[ravel_broadcast(idx, in[0].shape)], in[1].v[ravel_broadcast(idx, in[1].shape)]);
    }
    return y;
  };
}

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

// (.., M, K) @ (.., K, N) with batch dims equal or one side 2-D.
DT matmul_ref(const DT& a, const DT& b) {
  const int64_t M = a.shape[a.shape.size() - 2], K = a.shape.back(), N = b.shape.back();
  Shape batch = a.shape.size() > 2 ? Shape(a.shape.begin(), a.shape.end() - 2)
                                   : Shape(b.shape.begin(), b.shape.end() - 2);
  const int64_t nb = numel(batch);
  Shape out = batch;
  out.push_back(M);
  out.push_back(N);
  DT y{out, std::vector<double>(numel(out))};
  for (int64_t p = 0; p < nb; ++p) {
    const double* A = a.v.data() + (a.shape.size() > 2 ? p * M * K : 0);
    const double* B = b.v.data() + (b.shape.size() > 2 ? p * K * N : 0);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += A[i * K + k] * B[k * N + j];
        y.v[p * M * N + i * N + j] = s;
      }
  }
  return y;
}

DT transpose_last2(const DT& x) {
  const int64_t R = x.shape[x.shape.size() - 2], C = x.shape.back();
  Shape s = x.shape;
  std::swap(s[s.size() - 1], s[s.size() - 2]);
  DT y{s, std::vector<double>(x.v.size())};
  const int64_t nb = x.numel() / (R * C);
  for (int64_t p = 0; p < nb; ++p)
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j) y.v[p * R * C + j * R + i] = x.v[p * R * C + i * C + j];
  return y;
}

DT softmax_ref(const DT& x, double scale, bool causal) {
  const int64_t C = x.shape.back(), R = x.numel() / C;
  DT y{x.shape, std::vector<double>(x.v.size())};
  for (int64_t r = 0; r < R; ++r) {
    const int64_t limit = causal ? (r % C) + 1 : C;
    double mx = -INFINITY, s = 0;
    for (int64_t j = 0; j < limit; ++j) mx = std::max(mx, scale * x.v[r * C + j]);
    for (int64_t j = 0; j < limit; ++j) s += std::exp(scale * x.v[r * C + j] - mx);
    for (int64_t j = 0; j < C; ++j)
      y.v[r * C + j] = j < limit ? std::exp(scale * x.v[r * C + j] - mx) / s : 0.0;
  }
  return y;
}

DT layer_norm_ref(const DT& x, const DT& w, const DT& b, double eps) {
  const int64_t C = x.shape.back(), R = x.numel() / C;
  DT y{x.shape, std::vector<double>(x.v.size())};
  for (int64_t r = 0; r < R; ++r) {
    double m = 0, var = 0;
    for (int64_t j = 0; j < C; ++j) m += x.v[r * C + j];
    m /= C;
    for (int64_t j = 0; j < C; ++j) var += (x.v[r * C + j] - m) * (x.v[r * C + j] - m);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + eps);
    for (int64_t j = 0; j < C; ++j) y.v[r * C + j] = (x.v[r * C + j] - m) * rs * w.v[j] + b.v[j];
  }
  return y;
}

TEST(Ops, BinarySameShapeAndBroadcast) {
  const std::vector<std::pair<Shape, Shape>> shapes = {{{1}, {1}},          {{3, 17}, {3, 17}},
                                                       {{4, 5, 6}, {5, 6}}, {{2, 3, 4}, {3, 1}},
                                                       {{3, 1}, {1, 5}},    {{2, 7}, {}}};
  int seed = 1;
  for (auto [sa, sb] : shapes) {
    Tensor a = rand_tensor(sa, seed++), b = rand_tensor(sb, seed++);
    Tensor bpos = add(scale(b, 0.25f), full(sb, 1.0f)).detach();  // keep divisors away from 0
    check_op({"add",
              {a, b},
              [](auto& in) { return add(in[0], in[1]); },
              binary_ref([](double u, double v) { return u + v; })});
    check_op({"sub",
              {a, b},
              [](auto& in) { return sub(in[0], in[1]); },
              binary_ref([](double u, double v) { return u - v; })});
    check_op({"mul",
              {a, b},
              [](auto& in) { return mul(in[0], in[1]); },
              binary_ref([](double u, double v) { return u * v; })});
    check_op({"div",
              {a, bpos},
              [](auto& in) { return div(in[0], in[1]); },
              binary_ref([](double u, double v) { return u / v; })});
  }
}

TEST(Ops, ScaleAndGelu) {
  for (Shape s : {Shape{1}, Shape{17}, Shape{3, 33}}) {
    check_op({"scale",
              {rand_tensor(s, 3)},
              [](auto& in) { return scale(in[0], -1.5f); },
              [](auto& in) {
                DT y = in[0];
                for (double& v : y.v) v *= -1.5;
                return y;
              }});
    check_op({"gelu",
              {rand_tensor(s, 4, 4.0f)},
              [](auto& in) { return gelu(in[0]); },
              [](auto& in) {
                DT y = in[0];
                for (double& v : y.v) v = gelu_ref(v);
                return y;
              }});
  }
}

TEST(Ops, SumAndMean) {
  for (Shape s : {Shape{1}, Shape{5, 7}, Shape{2, 3, 17}}) {
    for (int64_t d = 0; d < static_cast<int64_t>(s.size()); ++d) {
      for (bool keep : {false, true}) {
        auto ref = [d, keep](const std::vector<DT>& in) {
          const DT& x = in[0];
          Shape out = x.shape;
          int64_t outer = 1, n = x.shape[d], inner = 1;
          for (int64_t i = 0; i < d; ++i) outer *= x.shape[i];
          for (size_t i = d + 1; i < x.shape.size(); ++i) inner *= x.shape[i];
          if (keep)
            out[d] = 1;
          else
            out.erase(out.begin() + d);
          DT y{out, std::vector<double>(outer * inner, 0.0)};
          for (int64_t o = 0; o < outer; ++o)
            for (int64_t j = 0; j < n; ++j)
              for (int64_t i = 0; i < inner; ++i)
                y.v[o * inner + i] += x.v[(o * n + j) * inner + i];
          return y;
        };
        check_op(
            {"sum", {rand_tensor(s, 5)}, [d, keep](auto& in) { return sum(in[0], d, keep); }, ref});
      }
    }
  }
  check_op({"mean(all)",
            {rand_tensor({4, 9}, 6)},
            [](auto& in) { return mean(in[0]); },
            [](auto& in) {
              double s = 0;
              for (double v : in[0].v) s += v;
              return DT{{}, {s / in[0].numel()}};
            }});
}

TEST(Ops, MatmulAllLayouts) {
  struct Case {
    Shape a, b;
    bool ta, tb;  // pass a transposed view (stored as the transpose)
  };
  const std::vector<Case> cases = {
      {{1, 1}, {1, 1}, false, false},     {{3, 5}, {5, 7}, false, false},
      {{3, 5}, {5, 7}, true, false},      {{3, 5}, {5, 7}, false, true},
      {{3, 5}, {5, 7}, true, true},       {{2, 3, 17, 5}, {2, 3, 5, 4}, false, true},
      {{4, 6, 5}, {5, 3}, false, false},  {{5, 3}, {4, 3, 6}, false, false},
      {{2, 1, 9}, {2, 9, 1}, true, false}};
  int seed = 10;
  for (const Case& c : cases) {
    // Store the transposed operand and take a transposed view of it in the op.
    auto stored = [](Shape s, bool t) {
      if (t) std::swap(s[s.size() - 1], s[s.size() - 2]);
      return s;
    };
    Tensor a = rand_tensor(stored(c.a, c.ta), seed++), b = rand_tensor(stored(c.b, c.tb), seed++);
    const bool ta = c.ta, tb = c.tb;
    check_op({"matmul",
              {a, b},
              [ta, tb](auto& in) {
                return matmul(ta ? transpose(in[0], -1, -2) : in[0],
                              tb ? transpose(in[1], -1, -2) : in[1]);
              },
              [ta, tb](const std::vector<DT>& in) {
                return matmul_ref(ta ? transpose_last2(in[0]) : in[0],
                                  tb ? transpose_last2(in[1]) : in[1]);
              },
              2e-5});
  }
}

TEST(Ops, Linear) {
  for (auto [x, n] :
       std::vector<std::pair<Shape, int64_t>>{{{1, 1}, 1}, {{3, 17}, 5}, {{2, 4, 8}, 33}}) {
    const int64_t K = x.back();
    Tensor xs = rand_tensor(x, 20), w = rand_tensor({n, K}, 21), b = rand_tensor({n}, 22);
    auto ref = [](const std::vector<DT>& in) {
      DT y = matmul_ref(in[0], transpose_last2(in[1]));
      const int64_t N = in[1].shape[0];
      if (in.size() == 3)
        for (int64_t i = 0; i < y.numel(); ++i) y.v[i] += in[2].v[i % N];
      return y;
    };
    check_op({"linear+bias",
              {xs, w, b},
              [](auto& in) { return linear(in[0], in[1], in[2]); },
              ref,
              2e-5});
    check_op({"linear", {xs, w}, [](auto& in) { return linear(in[0], in[1]); }, ref, 2e-5});
  }
}

TEST(Ops, Softmax) {
  for (Shape s : {Shape{1, 1}, Shape{3, 17}, Shape{2, 2, 9, 9}}) {
    for (bool causal : {false, true}) {
      if (causal && s[s.size() - 1] != s[s.size() - 2]) continue;
      check_op({"softmax",
                {rand_tensor(s, 30, 3.0f)},
                [causal](auto& in) { return softmax(in[0], 0.7f, causal); },
                [causal](auto& in) { return softmax_ref(in[0], 0.7, causal); }});
    }
  }
}

TEST(Ops, LayerNorm) {
  for (Shape s : {Shape{1, 1}, Shape{3, 17}, Shape{2, 5, 64}}) {
    const int64_t C = s.back();
    Tensor x = add(rand_tensor(s, 40, 2.0f), full({C}, 3.0f)).detach();
    Tensor w = rand_tensor({C}, 41), b = rand_tensor({C}, 42);
    check_op({"layer_norm",
              {x, w, b},
              [](auto& in) { return layer_norm(in[0], in[1], in[2], 1e-5f); },
              [](auto& in) { return layer_norm_ref(in[0], in[1], in[2], 1e-5); },
              2e-5,
              2e-4});
  }
}

DT rms_norm_ref(const DT& x, const DT& w, double eps) {
  const int64_t C = x.shape.back(), R = x.numel() / C;
  DT y{x.shape, std::vector<double>(x.v.size())};
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < C; ++j) ss += x.v[r * C + j] * x.v[r * C + j];
    const double rs = 1.0 / std::sqrt(ss / C + eps);
    for (int64_t j = 0; j < C; ++j) y.v[r * C + j] = x.v[r * C + j] * rs * w.v[j];
  }
  return y;
}

double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }

// Hugging Face's rotary embedding: q * cos + rotate_half(q) * sin on each head of (B, T, NH, d),
// the first `rot` heads, positions pos0 + t.
DT rope_ref(const DT& x, double theta, int64_t rot, int64_t pos0) {
  const int64_t B = x.shape[0], T = x.shape[1], NH = x.shape[2], d = x.shape[3], half = d / 2;
  DT y = x;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < rot; ++h) {
        const double* xr = x.v.data() + ((b * T + t) * NH + h) * d;
        double* yr = y.v.data() + ((b * T + t) * NH + h) * d;
        for (int64_t i = 0; i < d; ++i) {
          const double a = static_cast<double>(pos0 + t) * std::pow(theta, -2.0 * (i % half) / d);
          const double rotated = i < half ? -xr[i + half] : xr[i - half];  // rotate_half
          yr[i] = xr[i] * std::cos(a) + rotated * std::sin(a);
        }
      }
  return y;
}

TEST(Ops, RMSNorm) {
  for (Shape s : {Shape{1, 1}, Shape{3, 17}, Shape{2, 5, 64}, Shape{4, 33}}) {
    const int64_t C = s.back();
    Tensor x = rand_tensor(s, 140, 2.0f), w = rand_tensor({C}, 141);
    check_op({"rms_norm",
              {x, w},
              [](auto& in) { return rms_norm(in[0], in[1], 1e-5f); },
              [](auto& in) { return rms_norm_ref(in[0], in[1], 1e-5); },
              2e-5,
              2e-4});
  }
}

TEST(Ops, SiluAndSwiGLU) {
  for (Shape s : {Shape{1, 2}, Shape{3, 34}, Shape{2, 5, 40}}) {
    check_op({"silu",
              {rand_tensor(s, 150, 4.0f)},
              [](auto& in) { return silu(in[0]); },
              [](auto& in) {
                DT y = in[0];
                for (double& v : y.v) v = silu_ref(v);
                return y;
              }});
    check_op({"swiglu",
              {rand_tensor(s, 151, 4.0f)},
              [](auto& in) { return swiglu(in[0]); },
              [](const std::vector<DT>& in) {
                const int64_t F = in[0].shape.back() / 2, R = in[0].numel() / (2 * F);
                DT y{in[0].shape, std::vector<double>(R * F)};
                y.shape.back() = F;
                for (int64_t r = 0; r < R; ++r)
                  for (int64_t j = 0; j < F; ++j)
                    y.v[r * F + j] = silu_ref(in[0].v[r * 2 * F + j]) * in[0].v[r * 2 * F + F + j];
                return y;
              }});
  }
  EXPECT_THROW(swiglu(zeros({2, 3})), std::invalid_argument);
}

TEST(Ops, Rope) {
  // Odd head counts, d = 2 (one pair), heads left unrotated (v beside q and k), a start position
  // (a KV cache's new rows), and a strided input (a slice of a wider buffer).
  struct Case {
    Shape s;
    int64_t rot, pos0;
    double theta;
  };
  for (const Case& c : {Case{{1, 1, 1, 2}, 1, 0, 10000.0}, Case{{2, 5, 3, 8}, 2, 0, 10000.0},
                        Case{{1, 7, 4, 6}, 4, 3, 500000.0}, Case{{2, 3, 5, 4}, 0, 0, 10.0}}) {
    check_op({"rope",
              {rand_tensor(c.s, 160 + c.s[1])},
              [&](auto& in) { return rope(in[0], c.theta, c.rot, c.pos0); },
              [&](auto& in) { return rope_ref(in[0], c.theta, c.rot, c.pos0); }});
  }
  // Strided: heads 1..3 of a (2, 4, 5, 8) buffer.
  check_op({"rope strided",
            {rand_tensor({2, 4, 5, 8}, 170)},
            [](auto& in) { return rope(narrow(in[0], 2, 1, 3), 10000.0, 3, 2); },
            [](const std::vector<DT>& in) {
              DT x{{2, 4, 3, 8}, {}};
              for (int64_t r = 0; r < 8; ++r)
                for (int64_t h = 1; h < 4; ++h)
                  for (int64_t i = 0; i < 8; ++i) x.v.push_back(in[0].v[(r * 5 + h) * 8 + i]);
              return rope_ref(x, 10000.0, 3, 2);
            }});
  EXPECT_THROW(rope(zeros({1, 2, 2, 3}), 10000.0), std::invalid_argument);  // odd d

  // Far positions: the angles are the reference implementations' fp32 ones (inv_freq and
  // p * inv_freq rounded to float), which differ from exact angles by up to ~2e-4 rad here.
  const int64_t d = 16, half = d / 2, pos0 = 7000, T = 5;
  const double theta = 500000.0;
  const Tensor x = rand_tensor({1, T, 2, d}, 171);
  const auto got = rope(x, theta, 2, pos0).to_vector<float>();
  const DT xd = to_dt(x);
  double worst_fp32 = 0, worst_exact = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < d; ++i) {
        const int64_t j = i % half, o = (t * 2 + h) * d;
        const float inv =
            1.0f / static_cast<float>(std::pow(static_cast<double>(static_cast<float>(theta)),
                                               static_cast<double>(static_cast<float>(2 * j) / d)));
        const double a32 = static_cast<double>(static_cast<float>(pos0 + t) * inv);
        const double a64 = static_cast<double>(pos0 + t) * std::pow(theta, -2.0 * j / d);
        const double rotated = i < half ? -xd.v[o + i + half] : xd.v[o + i - half];
        const double ref32 = xd.v[o + i] * std::cos(a32) + rotated * std::sin(a32);
        const double ref64 = xd.v[o + i] * std::cos(a64) + rotated * std::sin(a64);
        worst_fp32 = std::max(worst_fp32, std::fabs(got[o + i] - ref32));
        worst_exact = std::max(worst_exact, std::fabs(got[o + i] - ref64));
      }
  EXPECT_LT(worst_fp32, 1e-6);   // a float rounding of cos/sin and of the products
  EXPECT_GT(worst_exact, 1e-5);  // the test tells the two angle conventions apart
}

TEST(Ops, SplitJoinsGradientsWrittenSideBySide) {
  Tensor x = rand_tensor({2, 7}, 175);
  check_op({"split",
            {x},
            [](auto& in) {
              auto parts = split(in[0], {3, 1, 3}, 1);
              return add(mul(parts[0], parts[2]), scale(parts[0], 2.0f));
            },
            [](const std::vector<DT>& in) {
              DT y{{2, 3}, std::vector<double>(6)};
              for (int64_t r = 0; r < 2; ++r)
                for (int64_t j = 0; j < 3; ++j)
                  y.v[r * 3 + j] =
                      in[0].v[r * 7 + j] * in[0].v[r * 7 + 4 + j] + 2.0 * in[0].v[r * 7 + j];
              return y;
            }});
  EXPECT_THROW(split(x, {3, 3}, 1), std::invalid_argument);
  // Gradients a primitive wrote side by side into one buffer (as the attention backward writes
  // dq, dk, dv) join into a view of that buffer, sizes differing along the dim: no copy.
  const Split op({3, 1, 3}, 1);
  const Tensor buffer = rand_tensor({2, 7}, 176);
  const std::vector<Tensor> parts = op.make_views(std::vector<Tensor>{buffer});
  const std::vector<Tensor> joined = op.vjp(std::vector<Tensor>{x}, parts, parts, {true});
  ASSERT_EQ(joined.size(), 1u);
  EXPECT_EQ(joined[0].shape(), (Shape{2, 7}));
  EXPECT_EQ(joined[0].raw_data(), buffer.raw_data());
  EXPECT_EQ(joined[0].to_vector<float>(), buffer.to_vector<float>());
}

TEST(Ops, Embedding) {
  Tensor w = rand_tensor({11, 5}, 50);
  Tensor idx = from_vector(std::vector<int32_t>{3, 0, 10, 3, 3, 7}, {2, 3});
  check_op({"embedding",
            {w, idx},
            [](auto& in) { return embedding(in[0], in[1]); },
            [](const std::vector<DT>& in) {
              const int64_t C = in[0].shape[1];
              Shape s = in[1].shape;
              s.push_back(C);
              DT y{s, {}};
              for (double id : in[1].v)
                for (int64_t j = 0; j < C; ++j)
                  y.v.push_back(in[0].v[static_cast<int64_t>(id) * C + j]);
              return y;
            }});
  EXPECT_THROW(embedding(w, from_vector(std::vector<int32_t>{11}, {1})), std::out_of_range);
}

TEST(Ops, CrossEntropyWithIgnoreIndex) {
  for (auto [N, V] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {5, 7}, {9, 33}}) {
    std::vector<int32_t> t(N);
    for (int64_t i = 0; i < N; ++i) t[i] = static_cast<int32_t>((i * 5 + 2) % V);
    if (N > 2) t[1] = -1;
    Tensor logits = rand_tensor({N, V}, 60, 4.0f), targets = from_vector(t, {N});
    check_op({"cross_entropy",
              {logits, targets},
              [](auto& in) { return cross_entropy(in[0], in[1], -1); },
              [](const std::vector<DT>& in) {
                const int64_t N = in[0].shape[0], V = in[0].shape[1];
                double total = 0;
                int64_t count = 0;
                for (int64_t i = 0; i < N; ++i) {
                  const int64_t tg = static_cast<int64_t>(in[1].v[i]);
                  if (tg == -1) continue;
                  double mx = -INFINITY, s = 0;
                  for (int64_t j = 0; j < V; ++j) mx = std::max(mx, in[0].v[i * V + j]);
                  for (int64_t j = 0; j < V; ++j) s += std::exp(in[0].v[i * V + j] - mx);
                  total += std::log(s) + mx - in[0].v[i * V + tg];
                  ++count;
                }
                return DT{{}, {total / count}};
              }});
  }
}

DT permute_ref(const DT& x, const std::vector<int64_t>& dims) {
  Shape s(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) s[i] = x.shape[dims[i]];
  DT y{s, std::vector<double>(x.v.size())};
  const Shape xs = contiguous_strides(x.shape);
  for (int64_t i = 0; i < y.numel(); ++i) {
    auto idx = unravel(i, s);
    int64_t o = 0;
    for (size_t k = 0; k < dims.size(); ++k) o += idx[k] * xs[dims[k]];
    y.v[i] = x.v[o];
  }
  return y;
}

TEST(Ops, ViewsAndCopies) {
  Tensor x = rand_tensor({2, 3, 4}, 70);
  check_op({"permute",
            {x},
            [](auto& in) {
              return contiguous(permute(in[0], {2, 0, 1}));
            },
            [](auto& in) {
              return permute_ref(in[0], {2, 0, 1});
            }});
  check_op({"transpose+reshape",
            {x},
            [](auto& in) {
              return reshape(transpose(in[0], 0, 2), {4, 6});
            },
            [](auto& in) {
              DT y = permute_ref(in[0], {2, 1, 0});
              y.shape = {4, 6};
              return y;
            }});
  check_op({"chunk",
            {x},
            [](auto& in) {
              auto parts = chunk(in[0], 2, -1);  // 2 x (2, 3, 2); use both, one scaled
              return add(parts[0], scale(parts[1], 2.0f));
            },
            [](auto& in) {
              DT y{{2, 3, 2}, {}};
              for (int64_t r = 0; r < 6; ++r)
                for (int64_t j = 0; j < 2; ++j)
                  y.v.push_back(in[0].v[r * 4 + j] + 2 * in[0].v[r * 4 + 2 + j]);
              return y;
            }});
  check_op({"chunk(one part used)",
            {x},
            [](auto& in) { return chunk(in[0], 3, 1)[2]; },
            [](auto& in) {
              DT y{{2, 1, 4}, {}};
              for (int64_t a = 0; a < 2; ++a)
                for (int64_t c = 0; c < 4; ++c) y.v.push_back(in[0].v[(a * 3 + 2) * 4 + c]);
              return y;
            }});
  check_op({"narrow",
            {x},
            [](auto& in) { return narrow(in[0], 1, 1, 2); },
            [](auto& in) {
              DT y{{2, 2, 4}, {}};
              for (int64_t a = 0; a < 2; ++a)
                for (int64_t b = 1; b < 3; ++b)
                  for (int64_t c = 0; c < 4; ++c) y.v.push_back(in[0].v[(a * 3 + b) * 4 + c]);
              return y;
            }});
  Tensor y = rand_tensor({2, 1, 4}, 71);
  check_op({"cat",
            {x, y},
            [](auto& in) {
              return cat({in[0], in[1]}, 1);
            },
            [](auto& in) {
              DT out{{2, 4, 4}, {}};
              for (int64_t a = 0; a < 2; ++a) {
                for (int64_t i = 0; i < 12; ++i) out.v.push_back(in[0].v[a * 12 + i]);
                for (int64_t i = 0; i < 4; ++i) out.v.push_back(in[1].v[a * 4 + i]);
              }
              return out;
            }});
  check_op({"expand",
            {rand_tensor({3, 1}, 72)},
            [](auto& in) {
              return contiguous(expand(in[0], {2, 3, 5}));
            },
            [](auto& in) {
              DT out{{2, 3, 5}, {}};
              for (int64_t a = 0; a < 2; ++a)
                for (int64_t b = 0; b < 3; ++b)
                  for (int64_t c = 0; c < 5; ++c) out.v.push_back(in[0].v[b]);
              return out;
            }});
}

TEST(Ops, Attention) {
  // T = 1, T below, at and across the 64-row block (partial last block), odd head sizes; q/k/v
  // as column slices of one fused buffer like the model passes them; causal and not. The naive
  // and the flash primitive against the same reference; for flash, T = 135 also crosses its
  // 128-key backward blocks (its 256-key forward blocks are crossed in test_flash_attention).
  using Op = Tensor (*)(const Tensor&, const Tensor&, const Tensor&, bool);
  // The attention kernels' fp32 products on the libraries and on the small GEMM
  // (backend/cpu/block_products.h), each forced in turn.
  for (cpu::BlockProducts products : {cpu::BlockProducts::kLibrary, cpu::BlockProducts::kSmall}) {
    cpu::set_block_products(products);
    for (auto [name, op] : {std::pair<const char*, Op>{"attention", &scaled_dot_product_attention},
                            std::pair<const char*, Op>{"flash_attention", &flash_attention}}) {
      auto shapes = std::vector<std::array<int64_t, 4>>{
          {1, 1, 1, 3}, {2, 2, 5, 3}, {1, 1, 64, 4}, {1, 1, 70, 3}, {1, 1, 131, 1}};
      if (std::string(name) == "flash_attention") shapes.push_back({1, 1, 135, 2});
      for (auto [B, H, T, d] : shapes) {
        for (bool causal : {true, false}) {
          Tensor qkv = rand_tensor({B, T, 3 * H * d}, 80 + T, 1.5f);
          auto heads = [&](const Tensor& t, int i) {
            return transpose(reshape(chunk(t, 3, -1)[i], {B, T, H, d}), 1, 2);
          };
          const double scale = 1.0 / std::sqrt(static_cast<double>(d));
          check_op({name,
                    {qkv},
                    [&](auto& in) {
                      return op(heads(in[0], 0), heads(in[0], 1), heads(in[0], 2), causal);
                    },
                    [&](const std::vector<DT>& in) {
                      // Split the fused (B, T, 3*H*d) reference into heads (B*H, T, d) each.
                      DT q{{B * H, T, d}, {}}, k = q, v = q;
                      for (DT* t : {&q, &k, &v}) t->v.assign(B * H * T * d, 0.0);
                      for (int64_t b = 0; b < B; ++b)
                        for (int64_t t = 0; t < T; ++t)
                          for (int64_t h = 0; h < H; ++h)
                            for (int64_t j = 0; j < d; ++j) {
                              const int64_t src = (b * T + t) * 3 * H * d + h * d + j;
                              const int64_t dst = ((b * H + h) * T + t) * d + j;
                              q.v[dst] = in[0].v[src];
                              k.v[dst] = in[0].v[src + H * d];
                              v.v[dst] = in[0].v[src + 2 * H * d];
                            }
                      DT y = matmul_ref(
                          softmax_ref(matmul_ref(q, transpose_last2(k)), scale, causal), v);
                      y.shape = {B, H, T, d};
                      return y;
                    },
                    2e-5});
        }
      }
    }
  }
  cpu::set_block_products(cpu::BlockProducts::kAuto);
  // The fused primitive and the matmul/softmax/matmul composition agree.
  Tensor q = rand_tensor({2, 3, 33, 8}, 90), k = rand_tensor({2, 3, 33, 8}, 91),
         v = rand_tensor({2, 3, 33, 8}, 92);
  const auto a = scaled_dot_product_attention(q, k, v, true).contiguous().to_vector<float>();
  const auto c = attention_composite(q, k, v, true).to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], c[i], 1e-5f);
}

TEST(Ops, GroupedQueryAttention) {
  // H query heads over Hkv key/value heads (Hkv = 1: multi-query), q, k, v as slices of one fused
  // (B, T, (H + 2 Hkv) d) buffer like the LLaMA model passes them; naive and flash, causal and
  // not, T across the blocks. The reference repeats each key/value head over its group.
  using Op = Tensor (*)(const Tensor&, const Tensor&, const Tensor&, bool);
  // The attention kernels' fp32 products on the libraries and on the small GEMM
  // (backend/cpu/block_products.h), each forced in turn.
  for (cpu::BlockProducts products : {cpu::BlockProducts::kLibrary, cpu::BlockProducts::kSmall}) {
    cpu::set_block_products(products);
    for (auto [name, op] : {std::pair<const char*, Op>{"attention", &scaled_dot_product_attention},
                            std::pair<const char*, Op>{"flash_attention", &flash_attention}}) {
      for (auto [B, H, Hkv, T, d] : std::vector<std::array<int64_t, 5>>{
               {1, 2, 1, 1, 3}, {2, 4, 2, 5, 3}, {1, 4, 2, 66, 2}, {1, 3, 1, 131, 1}}) {
        for (bool causal : {true, false}) {
          const int64_t W = (H + 2 * Hkv) * d;
          Tensor qkv = rand_tensor({B, T, W}, 180 + T + H, 1.5f);
          check_op({name,
                    {qkv},
                    [&](auto& in) {
                      auto p = split(reshape(in[0], {B, T, H + 2 * Hkv, d}), {H, Hkv, Hkv}, 2);
                      return op(transpose(p[0], 1, 2), transpose(p[1], 1, 2), transpose(p[2], 1, 2),
                                causal);
                    },
                    [&](const std::vector<DT>& in) {
                      DT q{{B * H, T, d}, {}}, k = q, v = q;
                      for (DT* t : {&q, &k, &v}) t->v.assign(B * H * T * d, 0.0);
                      for (int64_t b = 0; b < B; ++b)
                        for (int64_t t = 0; t < T; ++t)
                          for (int64_t h = 0; h < H; ++h)
                            for (int64_t j = 0; j < d; ++j) {
                              const int64_t row = (b * T + t) * W, kh = h / (H / Hkv);
                              const int64_t dst = ((b * H + h) * T + t) * d + j;
                              q.v[dst] = in[0].v[row + h * d + j];
                              k.v[dst] = in[0].v[row + (H + kh) * d + j];
                              v.v[dst] = in[0].v[row + (H + Hkv + kh) * d + j];
                            }
                      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
                      DT y = matmul_ref(
                          softmax_ref(matmul_ref(q, transpose_last2(k)), scale, causal), v);
                      y.shape = {B, H, T, d};
                      return y;
                    },
                    2e-5});
        }
      }
    }
  }
  cpu::set_block_products(cpu::BlockProducts::kAuto);
  EXPECT_THROW(
      scaled_dot_product_attention(zeros({1, 3, 4, 2}), zeros({1, 2, 4, 2}), zeros({1, 2, 4, 2})),
      std::invalid_argument);  // 2 does not divide 3
}

TEST(Ops, ShapeErrorsNameTheOpAndShapes) {
  try {
    matmul(zeros({2, 3}), zeros({4, 5}));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("matmul"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("(2, 3)"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("(4, 5)"), std::string::npos);
  }
  EXPECT_THROW(add(zeros({2, 3}), zeros({4})), std::invalid_argument);
  EXPECT_THROW(reshape(zeros({2, 3}), {4}), std::invalid_argument);
}

}  // namespace
}  // namespace kuai::test

namespace kuai::test {
namespace {

TEST(Ops, EmptyReductionDimensionGivesZerosOrBias) {
  // K = 0: the product is empty, so matmul gives zeros and linear gives the bias on every row.
  EXPECT_EQ(matmul(zeros({2, 0}), zeros({0, 3})).to_vector<float>(), std::vector<float>(6, 0.0f));
  EXPECT_EQ(matmul(zeros({4, 2, 0}), zeros({4, 0, 3})).to_vector<float>(),
            std::vector<float>(24, 0.0f));
  EXPECT_EQ(
      linear(zeros({2, 0}), zeros({3, 0}), from_vector({1.0f, 2.0f, 3.0f}, {3})).to_vector<float>(),
      (std::vector<float>{1, 2, 3, 1, 2, 3}));
}

TEST(Ops, CastRoundTripAndGradient) {
  // Rounding is not differentiable, so the cast's gradient is checked against its definition
  // (the incoming gradient cast back to the input's dtype) rather than by finite differences.
  Tensor x = from_vector({1.0f, -2.5f, 3.140625f, 1e-3f, 65504.0f}, {5});
  x.requires_grad_();
  Tensor h = cast(x, DType::kF16), b = cast(x, DType::kBF16);
  EXPECT_EQ(h.dtype(), DType::kF16);
  EXPECT_EQ(cast(h, DType::kF32).to_vector<float>()[4], 65504.0f);
  EXPECT_EQ(cast(b, DType::kF32).to_vector<float>()[2], 3.140625f);
  Tensor w = from_vector({1.0f, 2.0f, 3.0f, 4.0f, 5.0f}, {5});
  sum(mul(cast(h, DType::kF32), w)).backward();
  EXPECT_EQ(x.grad().to_vector<float>(), w.to_vector<float>());
  EXPECT_EQ(x.grad().dtype(), DType::kF32);
  // Elementwise ops keep a low-precision dtype (fp32 arithmetic, one rounding); fp32-only ops
  // (normalisation, softmax) refuse it outside autocast; matmuls refuse mixed dtypes.
  Tensor hh = add(h, h);
  EXPECT_EQ(hh.dtype(), DType::kF16);
  EXPECT_EQ(cast(hh, DType::kF32).to_vector<float>()[1], -5.0f);
  EXPECT_EQ(add(h, x).dtype(), DType::kF32);  // mixed: promoted to float32
  EXPECT_THROW(softmax(h), std::invalid_argument);
  EXPECT_THROW(matmul(reshape(x, {1, 5}), reshape(b, {5, 1})), std::invalid_argument);
}

}  // namespace
}  // namespace kuai::test
