// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the
// distributions drawn from it: uniform from the top 24 bits, normal by Box-Muller on pairs.
#include "kuai/core/rng.h"

#include <cmath>
#include <stdexcept>

#include "kuai/core/dispatch.h"
#include "kuai/core/primitives.h"

namespace kuai {
namespace {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline float to_unit(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }

}  // namespace

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_lo, uint64_t counter_hi) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(p1);
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

void Generator::uniform(float* out, int64_t n, float low, float high) {
  const uint64_t base = offset_;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t b = 0; b < (n + 3) / 4; ++b) {
    const auto r = philox4x32(seed_, base + b, stream_);
    for (int64_t j = 0; j < 4 && b * 4 + j < n; ++j)
      out[b * 4 + j] = low + (high - low) * to_unit(r[j]);
  }
  offset_ += static_cast<uint64_t>((n + 3) / 4);
}

void Generator::normal(float* out, int64_t n, float mean, float std) {
  const uint64_t base = offset_;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t b = 0; b < (n + 3) / 4; ++b) {
    const auto r = philox4x32(seed_, base + b, stream_);
    for (int pair = 0; pair < 2; ++pair) {
      // u1 in (0, 1] so the log is finite.
      const float u1 = (static_cast<float>(r[2 * pair] >> 8) + 1.0f) * (1.0f / 16777216.0f);
      const float u2 = to_unit(r[2 * pair + 1]);
      const float radius = std::sqrt(-2.0f * std::log(u1));
      const float angle = 6.283185307179586f * u2;
      const int64_t i = b * 4 + 2 * pair;
      if (i < n) out[i] = mean + std * radius * std::cos(angle);
      if (i + 1 < n) out[i + 1] = mean + std * radius * std::sin(angle);
    }
  }
  offset_ += static_cast<uint64_t>((n + 3) / 4);
}

void Generator::randint(int32_t* out, int64_t n, int32_t low, int32_t high) {
  const uint64_t base = offset_;
  const uint64_t range = static_cast<uint64_t>(static_cast<int64_t>(high) - low);
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t b = 0; b < (n + 3) / 4; ++b) {
    const auto r = philox4x32(seed_, base + b, stream_);
    for (int64_t j = 0; j < 4 && b * 4 + j < n; ++j)
      out[b * 4 + j] = low + static_cast<int32_t>((static_cast<uint64_t>(r[j]) * range) >> 32);
  }
  offset_ += static_cast<uint64_t>((n + 3) / 4);
}

Tensor Generator::draw(int kind, const Shape& shape, double a, double b, Device device) {
  const int64_t n = shape_numel(shape);
  Tensor t = dispatch(std::make_shared<RandomFill>(static_cast<RandomFill::Kind>(kind), shape,
                                                   seed_, stream_, offset_, a, b, device),
                      {})[0];
  offset_ += static_cast<uint64_t>((n + 3) / 4);
  return t;
}

void Generator::normal_(const Tensor& t, float mean, float std) {
  if (!t.is_contiguous() || t.dtype() != DType::kF32)
    throw std::invalid_argument("Generator::normal_: needs a contiguous float32 tensor, got " +
                                t.str());
  std::vector<Tensor> out = {t};
  evaluate(RandomFill(RandomFill::Kind::kNormal, t.shape(), seed_, stream_, offset_, mean, std,
                      t.device()),
           {}, out);
  offset_ += static_cast<uint64_t>((t.numel() + 3) / 4);
}

Tensor Generator::normal(const Shape& shape, float mean, float std, Device device) {
  return draw(static_cast<int>(RandomFill::Kind::kNormal), shape, mean, std, device);
}

Tensor Generator::uniform(const Shape& shape, float low, float high, Device device) {
  return draw(static_cast<int>(RandomFill::Kind::kUniform), shape, low, high, device);
}

Tensor Generator::randint(const Shape& shape, int32_t low, int32_t high, Device device) {
  return draw(static_cast<int>(RandomFill::Kind::kInt), shape, low, high, device);
}

}  // namespace kuai
