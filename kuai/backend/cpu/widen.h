// Low-precision tensors for the fp32 kernels. On CPUs without bf16/f16 arithmetic every kernel
// computes in fp32; an op whose inputs or outputs are bf16 or f16 (mixed precision, see
// kuai/amp/autocast.h) widens them at the edges. eval_widened does that for a whole primitive:
// fp32 copies of the low-precision inputs, fp32 temporaries for the low-precision outputs, the
// primitive's own fp32 evaluation, then one rounding (nearest even) into the real outputs. The
// temporaries come from the tracking allocator and live only for the call. Hot ops with large
// operands have dedicated paths instead (matmul and linear through gemm_lowp, cross-entropy in
// row blocks).
#pragma once

#include <algorithm>
#include <array>
#include <span>

#include "kuai/backend/cpu/convert.h"
#include "kuai/backend/cpu/parallel_chunks.h"
#include "kuai/core/primitive.h"

namespace kuai::cpu {

// Whether every floating tensor among `in` and `out` is float32 (the plain fp32 path applies).
bool all_f32(std::span<const Tensor> in, std::span<const Tensor> out);

// Evaluates p on fp32 versions of its operands (see above). p's eval_cpu must handle fp32.
void eval_widened(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out);

// Flat elementwise evaluation over contiguous operands of equal size and any floating dtypes:
// chunks of kWidenChunk elements are widened into per-thread fp32 buffers, fn(src, dst, n) runs
// the fp32 kernel on them (src: array of N input pointers), and the result is rounded once into
// `out`. One pass over memory and no temporaries; fp32 operands are used in place.
constexpr int64_t kWidenChunk = 4096;

template <size_t N, class Fn>
void map_widened(const std::array<const Tensor*, N>& in, const Tensor& out, Fn&& fn) {
  const int64_t n = out.numel();
  parallel_chunks(n, 4 * kWidenChunk, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[N + 1][kWidenChunk];
    for (int64_t c = begin; c < end; c += kWidenChunk) {
      const int64_t m = std::min(kWidenChunk, end - c);
      std::array<const float*, N> src;
      for (size_t i = 0; i < N; ++i) {
        const DType t = in[i]->dtype();
        if (t == DType::kF32) {
          src[i] = in[i]->template device_data<float>() + c;
        } else {
          convert_serial(static_cast<const char*>(in[i]->device_ptr()) + c * dtype_size(t), t,
                         buf[i], DType::kF32, m);
          src[i] = buf[i];
        }
      }
      const DType to = out.dtype();
      float* dst = to == DType::kF32 ? out.template device_data<float>() + c : buf[N];
      fn(src, dst, m);
      if (to != DType::kF32)
        convert_serial(buf[N], DType::kF32,
                       static_cast<char*>(out.device_ptr()) + c * dtype_size(to), to, m);
    }
  });
}

}  // namespace kuai::cpu
