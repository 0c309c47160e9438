// The scratch (kernel workspace) each CPU kernel of a training step takes from the tracking
// allocator while it runs, from the shapes and the thread count: the formulas of the kernels
// themselves (each function names the file whose allocation it mirrors). A list is a set of
// allocations held at once. GEMM scratch depends on the implementation the router chose on this
// machine and is measured instead (plan/costs.h). tests/plan/test_scratch_model.cpp runs each
// kernel and compares the allocator's peak with these.
#pragma once

#include <cstdint>
#include <vector>

#include "kuai/core/dtype.h"

namespace kuai::plan {

using Scratch = std::vector<int64_t>;  // bytes of each allocation held together

// backend/cpu/eval_attention.cpp (HeadScratch, grad_target) and flash_attention.cpp (work, Ds).
Scratch attention_forward_scratch(bool flash, int64_t B, int64_t H, int64_t Hkv, int64_t T,
                                  int64_t d, DType dtype, int threads);
Scratch attention_backward_scratch(bool flash, int64_t B, int64_t H, int64_t Hkv, int64_t T,
                                   int64_t d, DType dtype, int threads);
// backend/cpu/eval_nn.cpp (for_widened_chunks): low-precision logits are widened in row chunks;
// fp32 takes none. The same for forward and backward.
Scratch cross_entropy_scratch(int64_t rows, int64_t V, DType dtype, int threads);
// backend/cpu/eval_reduce.cpp (Sum::eval_cpu): a low-precision sum over `rows` rows of `inner`
// elements (the bias gradients under autocast); fp32 takes none.
Scratch sum_rows_scratch(int64_t rows, int64_t inner, DType dtype);

}  // namespace kuai::plan
