// Counter-based random numbers: Philox4x32-10 keyed by (seed, stream). Element i of a draw is a
// pure function of (seed, stream, offset + i), so results never depend on the thread count or on
// how the work is split. A Generator advances its offset past every draw; its state (three
// integers) is what a checkpoint saves.
#pragma once

#include <array>
#include <cstdint>

#include "kuai/core/tensor.h"

namespace kuai {

// One Philox4x32-10 block: 4 random 32-bit words for (key, 128-bit counter).
std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t counter_lo, uint64_t counter_hi);

class Generator {
 public:
  Generator(uint64_t seed = 0, uint64_t stream = 0) : seed_(seed), stream_(stream) {}

  // Draws into host memory (a loader's batch buffer, a kernel's output).
  void uniform(float* out, int64_t n, float low = 0.0f, float high = 1.0f);  // [low, high)
  void normal(float* out, int64_t n, float mean = 0.0f, float std = 1.0f);
  void randint(int32_t* out, int64_t n, int32_t low, int32_t high);  // [low, high)

  // Tensors of the same draws (contiguous float32 / int32) on `device`: a RandomFill primitive
  // at the generator's offset, which then advances past the draw as the host calls do.
  Tensor normal(const Shape& shape, float mean = 0.0f, float std = 1.0f,
                Device device = default_device());
  Tensor uniform(const Shape& shape, float low = 0.0f, float high = 1.0f,
                 Device device = default_device());
  Tensor randint(const Shape& shape, int32_t low, int32_t high, Device device = default_device());

  // The same draws written over a contiguous float32 tensor on its device, outside autograd and
  // capture (not dispatched): for initialising parameters in place.
  void normal_(const Tensor& t, float mean = 0.0f, float std = 1.0f);

  uint64_t seed() const { return seed_; }
  uint64_t stream() const { return stream_; }
  uint64_t offset() const { return offset_; }  // in Philox blocks
  void set_offset(uint64_t offset) { offset_ = offset; }

 private:
  Tensor draw(int kind, const Shape& shape, double a, double b, Device device);
  uint64_t seed_, stream_, offset_ = 0;
};

}  // namespace kuai
