// Test support: reproducible random inputs for kernel tests and benchmarks.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace kuai::test {

// n floats uniform in [lo, hi) from a seeded Mersenne twister.
inline std::vector<float> uniform(int64_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

}  // namespace kuai::test
