// `mpirun -np N kuai bench link`: the latency and bandwidth of the ranks' all-reduce, the two
// constants of the planner's collective model (kuai/plan/plan.h, Link): fp32 all-reduces through
// kuai's process group (its communication thread, as the gradient buckets go) of 4 B to 16 MiB,
// the median time of each size fitted (least squares in relative error) to t = 2(N-1) latency +
// 2(N-1)/N bytes / bandwidth. Rank 0 prints the table and the fit and saves it where `kuai plan`
// reads it (plan::link_file()). `kuai bench ddp` runs it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <stdexcept>

#include "bench.h"
#include "kuai/core/ops.h"
#include "kuai/distributed/process_group.h"
#include "kuai/plan/plan.h"

namespace kuai::app {

int run_link_bench(const std::vector<std::string>& args) {
  bool save = true;
  for (const std::string& a : args)
    if (a == "--no-save") save = false;
  auto group = dist::default_process_group({60.0});
  const int n = group->size();
  if (n < 2) {
    dist::finalize();
    throw std::invalid_argument(
        "bench link measures the ranks' all-reduce: run it under mpirun with 2 or more ranks");
  }
  std::vector<std::pair<double, double>> points;  // (bytes, seconds)
  for (int64_t bytes : {int64_t{4}, int64_t{4} << 10, int64_t{64} << 10, int64_t{1} << 20,
                        int64_t{4} << 20, int64_t{16} << 20}) {
    const Tensor t = full({bytes / 4}, 1.0f);
    const int reps = bytes <= (int64_t{64} << 10) ? 50 : 12;
    std::vector<double> times;
    for (int r = 0; r < reps + 3; ++r) {
      group->barrier();
      const auto t0 = std::chrono::steady_clock::now();
      group->all_reduce(t, dist::ReduceOp::kAvg)->wait();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r >= 3) times.push_back(s);
    }
    std::sort(times.begin(), times.end());
    points.emplace_back(static_cast<double>(bytes), times[times.size() / 2]);
  }
  // Least squares t = a + b bytes in relative error (weights 1/t^2), so that the small
  // all-reduces (latency) count as much as the large ones (bandwidth).
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    const double w = 1.0 / (y * y);
    sw += w;
    sx += w * x;
    sy += w * y;
    sxx += w * x * x;
    sxy += w * x * y;
  }
  const double b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx);
  const double a = std::max(0.0, (sy - b * sx) / sw);
  plan::Link link;
  link.latency_us = a / (2.0 * (n - 1)) * 1e6;
  link.bandwidth_gbs = b > 0 ? 2.0 * (n - 1) / n / b * 1e-9 : 0.0;
  if (group->rank() == 0) {
    std::cout << fmt::format("link: fp32 all-reduce over {} ranks ({})\n", n, group->backend());
    for (const auto& [x, y] : points)
      std::cout << fmt::format("  {:>10.0f} B  {:>9.1f} us  (fit {:.1f} us)\n", x, y * 1e6,
                               (a + b * x) * 1e6);
    std::cout << fmt::format("fit: t = 2(N-1) x {:.2f} us + 2(N-1)/N x bytes / {:.2f} GB/s\n",
                             link.latency_us, link.bandwidth_gbs);
    if (save && link.bandwidth_gbs > 0) {
      plan::save_link(link);
      std::cout << "saved to " << plan::link_file() << " (kuai plan reads it)\n";
    }
    std::cout << fmt::format("RESULT link_latency_us={:.2f} link_gbs={:.3f}\n", link.latency_us,
                             link.bandwidth_gbs);
  }
  dist::finalize();
  return 0;
}

}  // namespace kuai::app
