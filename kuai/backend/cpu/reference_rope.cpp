// Naive rotary embedding (see reference.h): Hugging Face's fp32 angles, the rotation in double.
#include <cmath>
#include <cstdint>

#include "kuai/backend/cpu/reference.h"

namespace kuai::cpu::ref {

void rope(const float* x, float* y, int64_t B, int64_t T, int64_t heads, int64_t d,
          int64_t rotated_heads, int64_t pos0, double theta, bool inverse) {
  const int64_t half = d / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = x + ((b * T + t) * heads + h) * d;
        float* yr = y + ((b * T + t) * heads + h) * d;
        if (h >= rotated_heads) {
          for (int64_t j = 0; j < d; ++j) yr[j] = xr[j];
          continue;
        }
        for (int64_t i = 0; i < half; ++i) {
          const float exponent = static_cast<float>(2 * i) / static_cast<float>(d);
          const float inv_freq =
              1.0f / static_cast<float>(std::pow(static_cast<double>(static_cast<float>(theta)),
                                                 static_cast<double>(exponent)));
          double a = static_cast<double>(static_cast<float>(pos0 + t) * inv_freq);
          if (inverse) a = -a;
          const double c = std::cos(a), s = std::sin(a), x0 = xr[i], x1 = xr[i + half];
          yr[i] = static_cast<float>(x0 * c - x1 * s);
          yr[i + half] = static_cast<float>(x1 * c + x0 * s);
        }
      }
}

}  // namespace kuai::cpu::ref
