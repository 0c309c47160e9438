// Strided copy (see strided.h).
#include "kuai/backend/cpu/strided.h"

#include <cstring>

namespace kuai::cpu {

void collapse_dims(Shape& shape, Shape& sa, Shape& sb, Shape& sc) {
  // Drop size-1 dims, then merge d into d+1 where every stride list allows it.
  Shape s2, a2, b2, c2;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 1) continue;
    s2.push_back(shape[i]);
    a2.push_back(sa[i]);
    b2.push_back(sb[i]);
    c2.push_back(sc[i]);
  }
  Shape s3, a3, b3, c3;
  for (size_t i = 0; i < s2.size(); ++i) {
    if (!s3.empty() && a3.back() == a2[i] * s2[i] && b3.back() == b2[i] * s2[i] &&
        c3.back() == c2[i] * s2[i]) {
      s3.back() *= s2[i];
      a3.back() = a2[i];
      b3.back() = b2[i];
      c3.back() = c2[i];
      continue;
    }
    s3.push_back(s2[i]);
    a3.push_back(a2[i]);
    b3.push_back(b2[i]);
    c3.push_back(c2[i]);
  }
  if (s3.empty()) {
    s3 = {1};
    a3 = {1};
    b3 = {1};
    c3 = {1};
  }
  shape = s3;
  sa = a3;
  sb = b3;
  sc = c3;
}

void copy_strided(const void* src, const Shape& src_strides, void* dst, const Shape& dst_strides,
                  const Shape& shape_in, int64_t es) {
  if (shape_numel(shape_in) == 0) return;
  Shape shape = shape_in, ss = src_strides, ds = dst_strides, unused(shape_in.size(), 0);
  collapse_dims(shape, ss, ds, unused);
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t inner = shape[nd - 1];
  const int64_t sin = ss[nd - 1], din = ds[nd - 1];
  const int64_t rows = shape_numel(shape) / inner;
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
#pragma omp parallel for schedule(static) if (rows * inner * es > (1 << 18) && rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    int64_t so = 0, dof = 0, rem = r;
    for (int64_t k = nd - 2; k >= 0; --k) {
      const int64_t idx = rem % shape[k];
      rem /= shape[k];
      so += idx * ss[k];
      dof += idx * ds[k];
    }
    const char* sp = s + so * es;
    char* dp = d + dof * es;
    if (sin == 1 && din == 1) {
      std::memcpy(dp, sp, static_cast<size_t>(inner * es));
    } else if (es == 4) {
      const float* sf = reinterpret_cast<const float*>(sp);
      float* df = reinterpret_cast<float*>(dp);
      for (int64_t i = 0; i < inner; ++i) df[i * din] = sf[i * sin];
    } else {
      for (int64_t i = 0; i < inner; ++i) std::memcpy(dp + i * din * es, sp + i * sin * es, es);
    }
  }
}

}  // namespace kuai::cpu
