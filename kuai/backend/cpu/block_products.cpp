// The attention kernels' choice of product kernel, by measurement (see block_products.h).
#include "kuai/backend/cpu/block_products.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "kuai/backend/cpu/gemm/router.h"
#include "kuai/backend/cpu/gemm/tuning.h"

namespace kuai::cpu {
namespace {

std::atomic<BlockProducts>& forced() {
  static std::atomic<BlockProducts> f{BlockProducts::kAuto};
  return f;
}

}  // namespace

const char* block_products_name(BlockProducts p) {
  switch (p) {
    case BlockProducts::kLibrary:
      return "library";
    case BlockProducts::kSmall:
      return "small";
    default:
      return "auto";
  }
}

int64_t block_products_bucket(int64_t T, int64_t lo, int64_t hi) {
  int64_t b = lo;
  while (b < T && b < hi) b *= 2;
  return std::min(b, hi);
}

void set_block_products(BlockProducts products) { forced().store(products); }

BlockProducts measured_block_products(const std::string& key, const std::string& what,
                                      const std::function<BlockProductsRun()>& prepare) {
  const BlockProducts f = forced().load();
  if (f != BlockProducts::kAuto) return f;
  TuningCache& cache = TuningCache::get();
  if (!cache.enabled() || routes_to_default_here()) return BlockProducts::kLibrary;
  auto from_name = [](const std::string& name) {
    return name == "small" ? BlockProducts::kSmall : BlockProducts::kLibrary;
  };
  if (const auto cached = cache.find(key)) return from_name(*cached);
  if (!cache.may_calibrate()) return BlockProducts::kLibrary;
  static std::mutex measuring;  // one measurement at a time; the first recorded stands
  std::lock_guard<std::mutex> lock(measuring);
  if (const auto cached = cache.find(key)) return from_name(*cached);
  const BlockProductsRun run = prepare();
  const std::function<void()> runs[] = {[&] { run(BlockProducts::kLibrary); },
                                        [&] { run(BlockProducts::kSmall); }};
  const std::vector<double> best = race(runs, {3, 20, 0.2});
  const BlockProducts winner =
      best[1] < best[0] ? BlockProducts::kSmall : BlockProducts::kLibrary;  // a tie: library
  const std::string measured =
      fmt::format("library {:.3f} small {:.3f} ms, {}", best[0] * 1e3, best[1] * 1e3, what);
  return from_name(cache.record({key, block_products_name(winner), measured}));
}

}  // namespace kuai::cpu
