// Shape checks and helpers shared by the primitives and ops: dim normalisation, broadcasting,
// the strides of a copy-free reshape, and the error messages that name the op and the shapes.
#pragma once

#include <optional>
#include <string_view>

#include "kuai/core/tensor.h"

namespace kuai {

int64_t normalize_dim(std::string_view op, int64_t dim, int64_t ndim);
void check_float32(std::string_view op, const Tensor& t);
void check_same_shape(std::string_view op, const Tensor& a, const Tensor& b);
Shape broadcast_shapes(std::string_view op, const Shape& a, const Shape& b);
// Strides for viewing (shape, strides) as new_shape without copying, if possible.
std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& new_shape);

}  // namespace kuai
