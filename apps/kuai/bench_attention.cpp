// `kuai bench attention`: the attention sweep of technique 6. For each dtype and sequence length
// T (causal, B = 1, H = 12, head_dim 64 by default) it times one forward + backward of kuai's flash
// attention and of kuai's naive attention, alternating (flash, naive, flash, naive, ...), and runs
// PyTorch's naive attention (bench/peers/torch_attention.py, one process per T) in the same run.
// Reported: median milliseconds, achieved GFLOP/s with the causal FLOPs counted honestly (the
// visible T (T + 1) / 2 pairs of each head: 4 d FLOPs per pair forward, 8 d backward; the flash
// backward's recomputation of the scores is not counted), and the extra memory of the pass: for
// kuai the allocator's peak above what was live before (q, k, v and dy), for PyTorch the peak
// resident set above the same point. Both include the gradient of the fused qkv input.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "kuai/core/allocator.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"

namespace kuai::app {
namespace {

struct Measure {
  double ms = -1;           // median; < 0: not run
  double lo = -1, hi = -1;  // the spread of the repetitions (kuai's own arms)
  double mib = -1;          // extra memory
  std::string note;         // why it was not run, or how it failed
  bool failed = false;
};

struct Row {
  std::string dtype;
  int64_t T = 0;
  Measure flash, naive, torch;
};

// The median: the middle value, or the mean of the two middle ones; -1 when there is none.
double median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<int64_t> parse_list(const std::string& name, const std::string& v) {
  std::vector<int64_t> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long long n = std::stoll(item, &used);
      if (used == item.size() && n > 0) {
        out.push_back(n);
        continue;
      }
    } catch (const std::exception&) {
    }
    throw std::invalid_argument("--" + name + ": '" + item + "' is not a positive integer");
  }
  return out;
}

struct Options {
  std::vector<int64_t> T = {512, 1024, 2048, 4096, 8192};
  std::vector<std::string> dtypes = {"fp32", "bf16"};
  int64_t batch = 1, heads = 12, head_dim = 64, reps = 3;
  int64_t naive_max_t = 4096;       // kuai's naive attention up to this T (8192: ~10 GiB)
  int64_t torch_max_t = 4096;       // the PyTorch peer in fp32 up to this T
  int64_t torch_bf16_max_t = 1024;  // ... and in bf16 (PyTorch 1.13's CPU bf16 GEMMs are slow)
  bool peer = true;
  std::string json = "runs/bench/attention.json";
};

// Causal FLOPs of one forward + backward, counted honestly.
double flops(const Options& o, int64_t T) {
  return 12.0 * static_cast<double>(o.head_dim) * static_cast<double>(T) * (T + 1) / 2.0 *
         static_cast<double>(o.batch * o.heads);
}

// One (flash | naive) forward + backward on q, k, v views of one (B, T, 3 H d) leaf, as the
// model makes them; returns the milliseconds, and the allocator's extra peak in `mib`.
double pass(bool flash, Tensor& qkv, const Tensor& dy, const Options& o, double* mib) {
  const int64_t B = o.batch, T = qkv.size(1), H = o.heads, d = o.head_dim;
  qkv.set_grad(Tensor());
  Allocator& alloc = Allocator::get();
  const int64_t before = alloc.stats().current;
  alloc.reset_peak();
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::vector<Tensor> parts = chunk(qkv, 3, -1);
    auto heads = [&](const Tensor& t) { return transpose(reshape(t, {B, T, H, d}), 1, 2); };
    Tensor y = flash ? flash_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]), true)
                     : scaled_dot_product_attention(heads(parts[0]), heads(parts[1]),
                                                    heads(parts[2]), true);
    y.backward(dy);
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  *mib = static_cast<double>(alloc.stats().peak - before) / (1 << 20);
  return ms;
}

// The PyTorch peer for one T, in its own process.
Measure run_peer(const Options& o, const std::string& dtype, int64_t T) {
  Measure m;
  const std::string script = "bench/peers/torch_attention.py";
  if (!std::filesystem::exists(script)) {
    m.note = script + " not found (run from the repository root)";
    m.failed = true;
    return m;
  }
  const std::string cmd = fmt::format(
      "OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 {} --T {} --dtype {} --threads {} --reps {} "
      "--batch {} --heads {} --head_dim {} 2>&1",
      script, T, dtype, omp_get_max_threads(), o.reps, o.batch, o.heads, o.head_dim);
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) {
    m.note = "cannot start /usr/bin/python3";
    m.failed = true;
    return m;
  }
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, f) != nullptr) out += buf;
  const int rc = pclose(f);
  const size_t at = out.find("RESULT ");
  double ms = 0, mib = 0;
  if (rc != 0 || at == std::string::npos ||
      std::sscanf(out.c_str() + at, "RESULT T=%*d dtype=%*s ms_median=%lf extra_mib=%lf", &ms,
                  &mib) != 2) {
    const size_t nl = out.find_last_of('\n', out.size() >= 2 ? out.size() - 2 : 0);
    m.note = "PyTorch peer failed: " + (nl == std::string::npos ? out : out.substr(nl + 1));
    m.failed = true;
    return m;
  }
  m.ms = ms;
  m.mib = mib;
  return m;
}

Row run_row(const Options& o, const std::string& dtype, int64_t T, std::ostream& progress) {
  Row row{dtype, T, {}, {}, {}};
  const DType t = dtype == "bf16" ? DType::kBF16 : DType::kF32;
  Generator g(static_cast<uint64_t>(T), 0);
  Tensor qkv = g.normal({o.batch, T, 3 * o.heads * o.head_dim}).to(t);
  qkv.requires_grad_();
  const Tensor dy = g.normal({o.batch, o.heads, T, o.head_dim}).to(t);
  const bool naive = T <= o.naive_max_t;
  std::vector<double> flash_ms, naive_ms;
  double mib = 0;
  // Round 0 warms up; then ABBA: flash first in odd rounds, naive first in even ones.
  for (int64_t r = 0; r <= o.reps; ++r) {
    for (int turn = 0; turn < 2; ++turn) {
      const bool flash_now = (turn == 0) == (r % 2 == 1 || !naive);
      if (flash_now) {
        const double f = pass(true, qkv, dy, o, &mib);
        row.flash.mib = std::max(row.flash.mib, mib);
        if (r > 0) flash_ms.push_back(f);
      } else if (naive) {
        const double n = pass(false, qkv, dy, o, &mib);
        row.naive.mib = std::max(row.naive.mib, mib);
        if (r > 0) naive_ms.push_back(n);
      }
    }
  }
  Allocator::get().empty_cache();
  auto spread = [](Measure& m, const std::vector<double>& v) {
    m.ms = median(v);
    if (v.empty()) return;
    m.lo = *std::min_element(v.begin(), v.end());
    m.hi = *std::max_element(v.begin(), v.end());
  };
  spread(row.flash, flash_ms);
  if (naive)
    spread(row.naive, naive_ms);
  else
    row.naive.note = fmt::format("not run above T = {} (--naive-max-t)", o.naive_max_t);
  const int64_t peer_max = dtype == "bf16" ? o.torch_bf16_max_t : o.torch_max_t;
  if (!o.peer)
    row.torch.note = "--no-peer";
  else if (T > peer_max)
    row.torch.note = fmt::format("not run above T = {}", peer_max);
  else
    row.torch = run_peer(o, dtype, T);
  progress << fmt::format(
      "  {} T {}: flash {:.1f} ms, naive {}, PyTorch {}\n", dtype, T, row.flash.ms,
      row.naive.ms >= 0 ? fmt::format("{:.1f} ms", row.naive.ms) : "-",
      row.torch.ms >= 0 ? fmt::format("{:.1f} ms", row.torch.ms) : row.torch.note);
  progress.flush();
  return row;
}

std::string cell(double v, const char* fmt_spec = "{:.1f}") {
  return v >= 0 ? fmt::format(fmt::runtime(fmt_spec), v) : "-";
}

}  // namespace

int run_attention_bench(const std::vector<std::string>& args) {
  Options o;
  for (const std::string& a : args) {
    auto value = [&](const std::string& name) -> const char* {
      const std::string p = "--" + name + "=";
      return a.rfind(p, 0) == 0 ? a.c_str() + p.size() : nullptr;
    };
    auto one = [&](const std::string& name, const char* v) {
      const auto l = parse_list(name, v);
      if (l.size() != 1) throw std::invalid_argument("--" + name + " takes one number");
      return l[0];
    };
    if (a == "attention") continue;
    if (const char* v = value("T")) {
      o.T = parse_list("T", v);
    } else if (const char* v = value("dtypes")) {
      o.dtypes.clear();
      std::stringstream ss(v);
      std::string d;
      while (std::getline(ss, d, ','))
        if (d == "fp32" || d == "bf16")
          o.dtypes.push_back(d);
        else
          throw std::invalid_argument("--dtypes: '" + d + "' is not fp32 or bf16");
    } else if (const char* v = value("reps")) {
      o.reps = one("reps", v);
    } else if (const char* v = value("batch")) {
      o.batch = one("batch", v);
    } else if (const char* v = value("heads")) {
      o.heads = one("heads", v);
    } else if (const char* v = value("head-dim")) {
      o.head_dim = one("head-dim", v);
    } else if (const char* v = value("naive-max-t")) {
      o.naive_max_t = one("naive-max-t", v);
    } else if (const char* v = value("torch-max-t")) {
      o.torch_max_t = one("torch-max-t", v);
    } else if (const char* v = value("torch-bf16-max-t")) {
      o.torch_bf16_max_t = one("torch-bf16-max-t", v);
    } else if (const char* v = value("threads")) {
      omp_set_num_threads(static_cast<int>(one("threads", v)));
    } else if (const char* v = value("json")) {
      o.json = v;
    } else if (a == "--no-peer") {
      o.peer = false;
    } else {
      throw std::invalid_argument(
          "bench attention: unknown option '" + a +
          "' (--T=LIST --dtypes=fp32,bf16 --reps=N --batch=N --heads=N --head-dim=N "
          "--naive-max-t=T --torch-max-t=T --torch-bf16-max-t=T --threads=N --json=FILE "
          "--no-peer)");
    }
  }
  std::cerr << fmt::format(
      "bench attention: causal, B {}, H {}, head_dim {}, {} threads; {} timed passes each "
      "(forward + backward) after one warm-up, kuai flash and naive alternating\n",
      o.batch, o.heads, o.head_dim, omp_get_max_threads(), o.reps);
  std::vector<Row> rows;
  for (const std::string& dtype : o.dtypes)
    for (int64_t T : o.T) rows.push_back(run_row(o, dtype, T, std::cerr));

  std::cout << fmt::format(
      "\nAttention forward + backward, causal, B {}, H {}, head_dim {}, {} threads (medians of "
      "{}; GFLOP/s = 12 d T(T+1)/2 B H / time; memory = extra peak of the pass)\n\n",
      o.batch, o.heads, o.head_dim, omp_get_max_threads(), o.reps);
  std::cout << "| dtype | T | flash ms (min-max) | flash GFLOP/s | flash MiB | kuai naive ms "
               "(min-max) | naive MiB | flash vs naive | PyTorch naive ms | PyTorch MiB | flash "
               "vs PyTorch: speed | memory |\n"
               "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  auto with_spread = [](const Measure& m) {
    return m.ms >= 0 ? fmt::format("{:.1f} ({:.1f}-{:.1f})", m.ms, m.lo, m.hi) : "-";
  };
  for (const Row& r : rows) {
    const double gf = flops(o, r.T) / (r.flash.ms * 1e6);
    std::string vs = "-";  // within noise when the repetitions' ranges overlap
    if (r.naive.ms > 0)
      vs = r.flash.lo <= r.naive.hi && r.naive.lo <= r.flash.hi
               ? "within noise"
               : fmt::format("{:.2f}x", r.naive.ms / r.flash.ms);
    std::cout << fmt::format(
        "| {} | {} | {} | {:.1f} | {} | {} | {} | {} | {} | {} | {} | {} |\n", r.dtype, r.T,
        with_spread(r.flash), gf, cell(r.flash.mib), with_spread(r.naive), cell(r.naive.mib), vs,
        cell(r.torch.ms), cell(r.torch.mib),
        r.torch.ms > 0 ? fmt::format("{:.2f}x", r.torch.ms / r.flash.ms) : "-",
        r.torch.mib > 0 ? fmt::format("{:.1f}%", 100.0 * r.flash.mib / r.torch.mib) : "-");
  }
  for (const Row& r : rows)
    if (r.torch.failed)
      std::cout << fmt::format("\nPyTorch {} T {}: {}\n", r.dtype, r.T, r.torch.note);

  std::ostringstream js;
  js << "{\n  \"config\": "
     << fmt::format(
            "{{\"batch\": {}, \"heads\": {}, \"head_dim\": {}, \"threads\": {}, \"reps\": {}, "
            "\"causal\": true}},\n",
            o.batch, o.heads, o.head_dim, omp_get_max_threads(), o.reps)
     << "  \"rows\": [\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    js << fmt::format(
        "    {{\"dtype\": \"{}\", \"T\": {}, \"flash_ms\": {:.3f}, \"flash_ms_min\": {:.3f}, "
        "\"flash_ms_max\": {:.3f}, \"flash_gflops\": {:.2f}, \"flash_mib\": {:.2f}, "
        "\"naive_ms\": {:.3f}, \"naive_ms_min\": {:.3f}, \"naive_ms_max\": {:.3f}, "
        "\"naive_mib\": {:.2f}, \"torch_ms\": {:.3f}, \"torch_mib\": {:.2f}}}{}\n",
        r.dtype, r.T, r.flash.ms, r.flash.lo, r.flash.hi, flops(o, r.T) / (r.flash.ms * 1e6),
        r.flash.mib, r.naive.ms, r.naive.lo, r.naive.hi, r.naive.mib, r.torch.ms, r.torch.mib,
        i + 1 < rows.size() ? "," : "");
  }
  js << "  ]\n}\n";
  const std::filesystem::path p(o.json);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream f(p);
  f << js.str();
  if (!f) throw std::runtime_error(o.json + ": cannot write");
  std::cout << "\nwrote " << o.json << " (-1: not run)\n";
  return 0;
}

}  // namespace kuai::app
