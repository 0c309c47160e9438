// Which kernel runs the fp32 products inside the attention kernels (naive and flash, forward and
// backward): the GEMM libraries' (cpu::gemm: oneDNN or OpenBLAS, as for every product) or the
// register-blocked small GEMM (gemm/small_gemm.h), with k and v transposed once per head or key
// block so that every product is NN or TN. The two differ in the order of their sums, so in the
// last bits. kAuto resolves, per kernel and head_dim, to the one measured faster on this machine
// (flash_products() in flash_attention.h, naive_attention_products() in attention.h), recorded in
// the GEMM tuning cache so that later runs make the same choice and get the same bits. bf16 and f16
// heads always take the libraries' path (gemm_lowp).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace kuai::cpu {

enum class BlockProducts { kAuto, kLibrary, kSmall };

const char* block_products_name(BlockProducts p);  // "library", "small", "auto"

// The sequence length a measurement runs at for an attention of T positions: the power of two at
// or above T, within [lo, hi] (a choice holds for every T of its bucket).
int64_t block_products_bucket(int64_t T, int64_t lo, int64_t hi);

// Testing and benchmark hook: force every attention kernel's products (kAuto restores the
// measured choices).
void set_block_products(BlockProducts products);

// A measurement's runs: run(products) runs the kernel once with its products on `products`.
using BlockProductsRun = std::function<void(BlockProducts)>;

// The measured choice for `key` ("flash products d64 t2"): the cached entry, else (where the
// tuning cache may calibrate, outside parallel regions) prepare() makes the operands and returns
// the run, and a race of run(kLibrary) against run(kSmall), A B A B ..., best times, decides; the
// faster is recorded with both times as "library 1.592 small 1.251 ms, <what>". Else kLibrary. A
// forced choice wins.
BlockProducts measured_block_products(const std::string& key, const std::string& what,
                                      const std::function<BlockProductsRun()>& prepare);

}  // namespace kuai::cpu
