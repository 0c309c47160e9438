// The one dispatch point every op goes through. It checks devices, makes inputs contiguous
// where the primitive needs it, allocates outputs through the tracking allocator, evaluates the
// primitive on the inputs' device (or creates its views), and records the autograd node when
// grad mode is on and an input requires grad. Autocast (mixed precision) and graph capture
// (compile) hook in here and nowhere else.
#pragma once

#include <memory>
#include <vector>

#include "kuai/core/primitive.h"

namespace kuai {

std::vector<Tensor> dispatch(std::shared_ptr<const Primitive> p, std::vector<Tensor> in);

// Evaluate on the device of the inputs, into preallocated outputs (no autograd, no checks).
void evaluate(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out);

}  // namespace kuai
