// Shape checks and helpers shared by the primitives and ops: dim normalisation, broadcasting,
// the strides of a copy-free reshape, and the error messages that name the op and the shapes.
#pragma once

#include <optional>
#include <span>
#include <string_view>

#include "kuai/core/tensor.h"

namespace kuai {

int64_t normalize_dim(std::string_view op, int64_t dim, int64_t ndim);
void check_float32(std::string_view op, const Tensor& t);
void check_floating(std::string_view op, const Tensor& t);  // f32, bf16 or f16
// Every tensor of `in` floating and of one dtype ("linear: dtypes float32 and bfloat16 differ").
void check_same_floating(std::string_view op, std::span<const Tensor> in);
// The dtype of a binary op's result: equal dtypes stay, anything else mixed is float32.
DType promote_types(DType a, DType b);
void check_same_shape(std::string_view op, const Tensor& a, const Tensor& b);
Shape broadcast_shapes(std::string_view op, const Shape& a, const Shape& b);
// Strides for viewing (shape, strides) as new_shape without copying, if possible.
std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& new_shape);

}  // namespace kuai
