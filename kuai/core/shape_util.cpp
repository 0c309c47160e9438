// Shape checks and helpers (see shape_util.h).
#include "kuai/core/shape_util.h"

#include <fmt/format.h>

#include <stdexcept>

namespace kuai {

int64_t normalize_dim(std::string_view op, int64_t dim, int64_t ndim) {
  const int64_t d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= ndim)
    throw std::invalid_argument(
        fmt::format("{}: dim {} out of range for a {}-D tensor", op, dim, ndim));
  return d;
}

void check_float32(std::string_view op, const Tensor& t) {
  if (t.dtype() != DType::kF32)
    throw std::invalid_argument(fmt::format("{}: expected float32, got {}", op, t.str()));
}

void check_floating(std::string_view op, const Tensor& t) {
  if (!is_floating(t.dtype()))
    throw std::invalid_argument(
        fmt::format("{}: expected float32, bfloat16 or float16, got {}", op, t.str()));
}

void check_same_floating(std::string_view op, std::span<const Tensor> in) {
  for (const Tensor& t : in) {
    check_floating(op, t);
    if (t.dtype() != in[0].dtype())
      throw std::invalid_argument(fmt::format("{}: dtypes {} and {} differ", op,
                                              dtype_name(in[0].dtype()), dtype_name(t.dtype())));
  }
}

DType promote_types(DType a, DType b) { return a == b ? a : DType::kF32; }

void check_same_shape(std::string_view op, const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape())
    throw std::invalid_argument(
        fmt::format("{}: shapes {} and {} differ", op, shape_str(a.shape()), shape_str(b.shape())));
}

Shape broadcast_shapes(std::string_view op, const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1)
      throw std::invalid_argument(
          fmt::format("{}: shapes {} and {} do not broadcast", op, shape_str(a), shape_str(b)));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

std::optional<Shape> view_strides(const Shape& shape, const Shape& strides,
                                  const Shape& new_shape) {
  if (shape.empty() || shape_numel(shape) == 0) return contiguous_strides(new_shape);
  // Walk the old dims from the innermost, grouping runs that are contiguous with each other;
  // each run must be covered exactly by a run of new dims.
  Shape out(new_shape.size(), 1);
  int64_t nd = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t base_stride = strides.back();
  int64_t old_numel = 1, new_numel = 1;
  for (int64_t od = static_cast<int64_t>(shape.size()) - 1; od >= 0; --od) {
    old_numel *= shape[od];
    const bool run_ends =
        od == 0 || (shape[od - 1] != 1 && strides[od - 1] != old_numel * base_stride);
    if (!run_ends) continue;
    while (nd >= 0 && (new_numel < old_numel || new_shape[nd] == 1)) {
      out[nd] = new_numel * base_stride;
      new_numel *= new_shape[nd];
      --nd;
    }
    if (new_numel != old_numel) return std::nullopt;
    if (od > 0) {
      base_stride = strides[od - 1];
      old_numel = 1;
      new_numel = 1;
    }
  }
  if (nd != -1) return std::nullopt;
  return out;
}

}  // namespace kuai
