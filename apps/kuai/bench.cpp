// `kuai bench`: the technique ablations (`--all` or a technique name: see train/ablation.h) and
// the machine's ceilings (`machine|gemm|bandwidth|adamw [--threads=N]`). Each machine row is a
// median of repeated measurements in this one process; the GEMM ceiling (2048^3 fp32) is the
// reference the model FLOP rates are quoted against, the triad bandwidth the floor AdamW is
// quoted against.
#include "bench.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>

#include "command.h"
#include "kuai/backend/cpu/gemm/gemm.h"
#include "kuai/backend/cpu/isa.h"
#include "kuai/backend/cpu/kernels.h"
#include "kuai/core/ops.h"
#include "kuai/core/rng.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/offload_adamw.h"
#include "kuai/plan/disk.h"
#include "kuai/train/ablation.h"
#include "kuai/train/compile_bench.h"
#include "kuai/train/config.h"

namespace kuai::app {
namespace {

// "Intel(R) Xeon(R) ... (family 6 model 207), tier avx512_bf16, 2 threads": the chart's title.
std::string machine_line() {
  const cpu::CpuId& id = cpu::cpu_id();
  return fmt::format("{} (family {} model {}), tier {}{}, {} threads", id.model_name, id.family,
                     id.model, cpu::isa_name(cpu::isa()),
                     cpu::max_isa_request().empty() ? "" : " (capped by KUAI_MAX_ISA)",
                     omp_get_max_threads());
}

double median_ms(int reps, const std::function<void()>& f) {
  std::vector<double> t;
  f();  // warm up
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  const size_t n = t.size();
  return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

// The machine's fp32 GEMM ceiling: the best median over a square 2048^3 product and the
// GPT-shaped products of the tiny and GPT-2 124M models (forward NT, input-gradient NN, weight-
// gradient TN), on each library and on kuai's own blocked GEMM forced in turn, 2 threads as
// configured. Training's model FLOPs
// are quoted against it: a step cannot run its products faster than the best of them.
double bench_gemm() {
  struct Product {
    const char* name;
    bool ta, tb;
    int64_t m, n, k;
  };
  const Product products[] = {
      {"square 2048^3", false, false, 2048, 2048, 2048},
      {"tiny qkv", false, true, 4096, 768, 256},
      {"tiny fc", false, true, 4096, 1024, 256},
      {"tiny fc_proj dX", false, false, 4096, 256, 1024},
      {"gpt2 qkv", false, true, 1024, 2304, 768},
      {"gpt2 fc", false, true, 1024, 3072, 768},
      {"gpt2 fc_proj dX", false, false, 1024, 768, 3072},
      {"gpt2 fc dW", true, false, 3072, 768, 1024},
  };
  Generator g(1, 0);
  double best = 0.0;
  std::string best_what;
  for (const Product& p : products) {
    const int64_t lda = p.ta ? p.m : p.k, ldb = p.tb ? p.k : p.n;
    Tensor a = g.normal({p.m * p.k}), b = g.normal({p.k * p.n}), c = zeros({p.m * p.n});
    std::string row = fmt::format("gemm      {:<16} {}{} {}x{}x{}:", p.name, p.ta ? 'T' : 'N',
                                  p.tb ? 'T' : 'N', p.m, p.n, p.k);
    for (cpu::GemmBackend backend :
         {cpu::GemmBackend::kOneDNN, cpu::GemmBackend::kOpenBLAS, cpu::GemmBackend::kKuai}) {
      cpu::set_gemm_backend(backend);
      const double ms = median_ms(5, [&] {
        cpu::gemm(p.ta, p.tb, p.m, p.n, p.k, 1.0f, a.data<float>(), lda, b.data<float>(), ldb, 0.0f,
                  c.data<float>(), p.n);
      });
      const double gflops = 2.0 * p.m * p.n * p.k / (ms * 1e6);
      const char* lib = backend == cpu::GemmBackend::kOneDNN     ? "oneDNN"
                        : backend == cpu::GemmBackend::kOpenBLAS ? "OpenBLAS"
                                                                 : "kuai";
      row += fmt::format(" {} {:.1f}", lib, gflops);
      if (gflops > best) {
        best = gflops;
        best_what = fmt::format("{} {}", p.name, lib);
      }
    }
    cpu::set_gemm_backend(cpu::GemmBackend::kAuto);
    std::cout << row << " GFLOP/s\n";
  }
  std::cout << fmt::format("gemm      ceiling {:.1f} GFLOP/s fp32 ({}; {} threads, tier {})\n",
                           best, best_what, omp_get_max_threads(), cpu::isa_name(cpu::isa()));
  std::cout << fmt::format("RESULT gemm_gflops={:.1f}\n", best);
  return best;
}

// STREAM triad a = b + s*c over arrays far larger than the caches: 12 bytes per element.
double bench_triad() {
  const int64_t n = int64_t{1} << 26;  // 256 MiB per array
  Tensor a = zeros({n}), b = full({n}, 1.0f), c = full({n}, 2.0f);
  float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const float* pc = c.data<float>();
  const double ms = median_ms(7, [&] {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.0f * pc[i];
  });
  const double gbs = 12.0 * static_cast<double>(n) / (ms * 1e6);
  std::cout << fmt::format("bandwidth triad, 3 x 256 MiB: {:.1f} GB/s\n", gbs);
  std::cout << fmt::format("RESULT triad_gbs={:.1f}\n", gbs);
  return gbs;
}

void bench_adamw(double triad_gbs) {
  const int64_t n = 124'439'808;  // parameters of GPT-2 124M (tied embeddings)
  Generator g(2, 0);
  Tensor p = g.normal({n}, 0.0f, 0.02f), grad = g.normal({n}, 0.0f, 1e-3f);
  Tensor m = zeros({n}), v = zeros({n});
  cpu::AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f, 1.0f};
  const double ms = median_ms(5, [&] {
    cpu::adamw_step(p.data<float>(), grad.data<float>(), m.data<float>(), v.data<float>(), n, hp);
  });
  const double floor_ms = 28.0 * static_cast<double>(n) / (triad_gbs * 1e6);
  std::cout << fmt::format(
      "adamw     124M params: {:.1f} ms; floor at triad bandwidth (28 B/param) {:.1f} ms; "
      "ratio {:.2f}\n",
      ms, floor_ms, ms / floor_ms);
  std::cout << fmt::format("RESULT adamw_ms={:.1f} adamw_floor_ms={:.1f} adamw_ratio={:.2f}\n", ms,
                           floor_ms, ms / floor_ms);
}

// `kuai bench compile`: eager against compiled steps interleaved in one process, in fp32 and bf16
// (or the precision an override names), on the default job's model (synthetic tokens: the batch
// does not change a step's time).
int run_compile_bench(const std::vector<std::string>& args) {
  std::vector<std::string> overrides;
  int64_t steps = 12, warmup = 2;
  std::string config_path;
  bool precision_given = false;
  for (const std::string& a : args) {
    auto number = [&](const std::string& v) {
      const long long n = std::stoll(v);
      if (n <= 0) throw std::invalid_argument(a + ": not a positive integer");
      return static_cast<int64_t>(n);
    };
    if (a == "compile") continue;
    if (a.rfind("--steps=", 0) == 0)
      steps = number(a.substr(8));
    else if (a.rfind("--warmup=", 0) == 0)
      warmup = number(a.substr(9));
    else if (a.rfind("--config=", 0) == 0)
      config_path = a.substr(9);
    else if (a.rfind("--", 0) == 0) {
      overrides.push_back(a);
      precision_given = precision_given || a.rfind("--train.precision=", 0) == 0;
    } else
      throw std::invalid_argument("bench compile: unknown argument " + a);
  }
  train::TrainConfig base = train::load_config(config_path, overrides);
  if (base.threads > 0) omp_set_num_threads(static_cast<int>(base.threads));
  std::vector<train::CompileBench> runs;
  for (const std::string& p : precision_given ? std::vector<std::string>{base.precision}
                                              : std::vector<std::string>{"fp32", "bf16"}) {
    train::TrainConfig c = base;
    c.precision = p;
    runs.push_back(train::run_compile_bench(c, steps, warmup, std::cerr));
  }
  std::cout << machine_line() << "\n" << train::compile_bench_markdown(runs);
  for (const auto& r : runs)
    if (!r.losses_equal) return 1;
  return 0;
}

int run_ablation_bench(const std::vector<std::string>& args) {
  std::vector<std::string> techniques, overrides;
  std::string config_path, json_path = "runs/bench/ablation.json",
                           svg_path = "runs/bench/ablation.svg";
  train::AblationOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](const std::string& name) -> std::optional<std::string> {
      if (a == "--" + name) {
        if (i + 1 >= args.size()) throw std::invalid_argument("--" + name + " needs a value");
        return args[++i];
      }
      if (a.rfind("--" + name + "=", 0) == 0) return a.substr(name.size() + 3);
      return std::nullopt;
    };
    auto integer = [&](const std::string& name, const std::string& v) {
      try {
        size_t used = 0;
        const long long n = std::stoll(v, &used);
        if (used == v.size() && n > 0) return static_cast<int64_t>(n);
      } catch (const std::exception&) {
      }
      throw std::invalid_argument("--" + name + " = '" + v + "' is not a positive integer");
    };
    if (a == "--all") {
      techniques = train::ablation_techniques();
      techniques.push_back("checkpoint");
    } else if (auto v = value("config")) {
      config_path = *v;
    } else if (auto v = value("json")) {
      json_path = *v;
    } else if (auto v = value("svg")) {
      svg_path = *v;
    } else if (auto v = value("steps")) {
      o.steps = integer("steps", *v);
    } else if (auto v = value("rounds")) {
      o.rounds = integer("rounds", *v);
    } else if (auto v = value("warmup")) {
      o.warmup = integer("warmup", *v);
    } else if (a.rfind("--", 0) == 0) {
      overrides.push_back(a);  // --section.key=value for the workload
    } else {
      techniques.push_back(a);
    }
  }
  // The workload: the default job's model on its corpus when present, shorter sequences.
  train::TrainConfig base = train::load_config(config_path, overrides);
  if (config_path.empty() && base.data_source == "file" && !std::filesystem::exists(base.data_path))
    base.data_source = "synthetic";
  std::vector<train::AblationRow> rows;
  std::optional<train::CheckpointBench> ck;
  for (const std::string& t : techniques) {
    if (t == "checkpoint")
      ck = train::run_checkpoint_bench(base, std::max<int64_t>(3, o.rounds),
                                       "runs/bench/checkpoint_scratch", std::cerr);
    else
      rows.push_back(train::run_ablation(t, base, o, std::cerr));
  }
  if (!rows.empty()) std::cout << train::ablation_markdown(rows);
  if (ck) std::cout << (rows.empty() ? "" : "\n") << train::checkpoint_markdown(*ck);
  for (const auto& [path, text] :
       {std::pair{json_path, train::ablation_json(rows, base, o, ck ? &*ck : nullptr)},
        std::pair{svg_path, train::ablation_svg(rows, machine_line())}}) {
    const std::filesystem::path p(path);
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
    std::ofstream f(p);
    f << text;
    if (!f) throw std::runtime_error(path + ": cannot write");
    std::cout << "wrote " << path << "\n";
  }
  return 0;
}

// `kuai bench disk`: the streamed bandwidth an offloaded optimizer gets from the disk under
// --dir, at the chunk size; saved for `kuai plan`.
int run_disk_bench(const std::vector<std::string>& args) {
  plan::DiskBenchOptions o;
  o.dir = "runs/offload_bench";
  for (const std::string& a : args) {
    if (a == "disk") continue;
    if (a.rfind("--dir=", 0) == 0)
      o.dir = a.substr(6);
    else if (a.rfind("--gib=", 0) == 0)
      o.bytes =
          static_cast<int64_t>(positive_number("gib", a.substr(6)) * double(int64_t{1} << 30));
    else if (a.rfind("--chunk-mb=", 0) == 0)
      o.chunk_bytes =
          static_cast<int64_t>(positive_number("chunk-mb", a.substr(11)) * double(1 << 20));
    else if (a.rfind("--rounds=", 0) == 0)
      o.rounds = static_cast<int64_t>(positive_number("rounds", a.substr(9)));
    else
      throw std::invalid_argument("bench disk: unknown argument " + a +
                                  " (--dir=PATH, --gib=N per file, --chunk-mb=N, --rounds=N)");
  }
  std::cerr << fmt::format(
      "bench disk: {} files of {:.2f} GiB in {}, chunks of {:.0f} MiB, {} rounds (write, read, "
      "read+write passes)\n",
      o.files, double(o.bytes) / double(int64_t{1} << 30), o.dir, double(o.chunk_bytes) / (1 << 20),
      o.rounds);
  const plan::Disk d = plan::measure_disk(o);
  std::cout << machine_line() << "\n"
            << fmt::format(
                   "| pass | GB/s (median of {} rounds) |\n|---|---|\n| write | {:.3f} |\n| read "
                   "| {:.3f} |\n| read and write every chunk (bytes both ways) | {:.3f} |\n| the "
                   "same, one request at a time (no overlap) | {:.3f} |\n",
                   o.rounds, d.write_gbs, d.read_gbs, d.update_gbs, d.serial_update_gbs)
            << d.source << ", chunks of " << d.chunk_bytes / (1 << 20) << " MiB, under " << d.dir
            << "\n";
  plan::save_disk(d);
  std::cout << "saved for kuai plan: " << plan::disk_file() << "\n";
  return 0;
}

// `kuai bench offload-update`: AdamW's update over moments offloaded to disk against the same
// update in memory, side by side (ABBA rounds) on the same number of parameters, beside the I/O
// floor: the bytes the pass moves (both moments read and written) over the disk's update-pass
// bandwidth, measured in this run on files of the same size at the same chunk size. --masters:
// the fp32 master weights offloaded too (train.offload_master), the parameters kept as bf16
// working copies, a third file read and written.
int run_offload_update_bench(const std::vector<std::string>& args) {
  double params_m = 124.4;  // GPT-2 124M's parameters
  int64_t chunk_mb = 64, rounds = 5;
  bool masters = false;
  std::string dir = "runs/offload_bench";
  for (const std::string& a : args) {
    if (a == "offload-update") continue;
    if (a == "--masters")
      masters = true;
    else if (a.rfind("--params-m=", 0) == 0)
      params_m = std::stod(a.substr(11));
    else if (a.rfind("--chunk-mb=", 0) == 0)
      chunk_mb = std::stoll(a.substr(11));
    else if (a.rfind("--rounds=", 0) == 0)
      rounds = std::stoll(a.substr(9));
    else if (a.rfind("--dir=", 0) == 0)
      dir = a.substr(6);
    else
      throw std::invalid_argument("bench offload-update: unknown argument " + a +
                                  " (--params-m=N millions, --chunk-mb=N, --rounds=N, --dir=PATH, "
                                  "--masters)");
  }
  if (params_m <= 0 || chunk_mb < 1 || rounds < 1)
    throw std::invalid_argument("bench offload-update: sizes and rounds must be positive");
  // The parameters as a model has them: tensors of a few million elements.
  const int64_t n = static_cast<int64_t>(params_m * 1e6);
  const int64_t piece = int64_t{3} << 20;
  auto make = [&](uint64_t seed) {
    Generator g(seed, 0);
    std::vector<Tensor> ps;
    for (int64_t at = 0; at < n; at += piece) {
      Tensor p = g.normal({std::min(piece, n - at)}, 0.0f, 0.02f).requires_grad_();
      p.set_grad(g.normal(p.shape(), 0.0f, 1e-3f));
      ps.push_back(p);
    }
    return std::vector<optim::ParamGroup>{{ps, 0.1f}};
  };
  optim::AdamWOptions ao;
  ao.lr = 1e-4f;
  // The disk first, on files of the moments' size.
  plan::DiskBenchOptions dopt;
  dopt.dir = dir;
  dopt.bytes = n * 4;
  dopt.chunk_bytes = chunk_mb << 20;
  dopt.rounds = 3;
  std::cerr << fmt::format(
      "bench offload-update: {:.1f} M parameters, chunks of {} MiB, {} rounds; "
      "measuring the disk under {} first\n",
      double(n) / 1e6, chunk_mb, rounds, dir);
  const plan::Disk disk = plan::measure_disk(dopt);
  const double moved = (masters ? 6.0 : 4.0) * 4.0 * double(n);  // each file read and written
  const double floor_ms = moved / (disk.update_gbs * 1e9) * 1e3;

  auto a_groups = make(1), b_groups = make(1);
  const int64_t before = Allocator::get().stats().current;
  optim::AdamW in_memory(a_groups, ao);
  in_memory.step();  // the moments are made at the first step
  const int64_t memory_bytes = Allocator::get().stats().current - before;
  const int64_t before_off = Allocator::get().stats().current;
  optim::OffloadOptions oo{(std::filesystem::path(dir) / "moments").string(), chunk_mb << 20};
  if (masters) oo.master_params = b_groups[0].params;
  optim::OffloadedAdamW offloaded(b_groups, ao, oo);
  offloaded.step();
  // With the masters: the parameters' 2 bytes each given back (bf16 working copies) are not
  // optimizer memory; what the optimizer holds is its buffers either way.
  const int64_t offload_bytes =
      Allocator::get().stats().current - before_off + (masters ? 2 * n : 0);
  std::vector<double> t_mem, t_off;
  using Clock = std::chrono::steady_clock;
  auto time = [](optim::Optimizer& o) {
    const auto t0 = Clock::now();
    o.step();
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  for (int64_t r = 0; r < rounds; ++r) {
    if (r % 2 == 0) {
      t_mem.push_back(time(in_memory));
      t_off.push_back(time(offloaded));
    } else {
      t_off.push_back(time(offloaded));
      t_mem.push_back(time(in_memory));
    }
  }
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const auto [mlo, mhi] = std::minmax_element(t_mem.begin(), t_mem.end());
  const auto [olo, ohi] = std::minmax_element(t_off.begin(), t_off.end());
  const io::StreamStats& st = offloaded.stream().stats();
  std::cout
      << machine_line() << "\n"
      << fmt::format(
             "| AdamW update, {:.1f} M parameters | median ms (min-max, {} rounds ABBA) | "
             "resident optimizer memory |\n|---|---|---|\n"
             "| in memory | {:.1f} ({:.1f}-{:.1f}) | {:.1f} MiB ({:.2f} B/param) |\n"
             "| offloaded to disk ({}{} MiB chunks, {}) | {:.1f} ({:.1f}-{:.1f}) | {:.1f} MiB "
             "({:.3f} B/param) |\n"
             "| I/O floor: {:.2f} GB moved / {:.3f} GB/s (disk update pass, this run) | "
             "{:.1f} | |\n",
             double(n) / 1e6, rounds, med(t_mem), *mlo, *mhi, double(memory_bytes) / (1 << 20),
             double(memory_bytes) / double(n),
             masters ? "moments and fp32 masters, parameters in bf16; " : "", chunk_mb,
             offloaded.stream().direct() ? "O_DIRECT, io_uring" : "page cache, io_uring",
             med(t_off), *olo, *ohi, double(offload_bytes) / (1 << 20),
             double(offload_bytes) / double(n), moved / 1e9, disk.update_gbs, floor_ms)
      << fmt::format(
             "offloaded update: {:.2f}x the I/O floor, {:.2f}x the in-memory update; the "
             "stream waited {:.0f} ms for the disk and updated for {:.0f} ms over {} "
             "passes; disk here: read {:.3f}, write {:.3f} GB/s\n",
             med(t_off) / floor_ms, med(t_off) / med(t_mem), st.wait_ms, st.busy_ms, rounds + 1,
             disk.read_gbs, disk.write_gbs)
      << fmt::format(
             "RESULT offload_update_ms={:.1f} io_floor_ms={:.1f} floor_ratio={:.3f} "
             "adamw_ms={:.1f} resident_mib={:.1f} adamw_resident_mib={:.1f}\n",
             med(t_off), floor_ms, med(t_off) / floor_ms, med(t_mem),
             double(offload_bytes) / (1 << 20), double(memory_bytes) / (1 << 20));
  return 0;
}

}  // namespace

int run_bench(const std::vector<std::string>& args) {
  std::string what = "machine";
  for (const std::string& a : args)
    if (a == "attention") return run_attention_bench(args);
  for (const std::string& a : args)
    if (a == "ddp") return run_ddp_bench(args);
  for (const std::string& a : args)
    if (a == "link") return run_link_bench(args);
  for (const std::string& a : args)
    if (a == "plan") return run_plan_bench(args);
  for (const std::string& a : args)
    if (a == "tokenizer") return run_tokenizer_bench(args);
  for (const std::string& a : args)
    if (a == "disk") return run_disk_bench(args);
  for (const std::string& a : args)
    if (a == "offload-update") return run_offload_update_bench(args);
  for (const std::string& a : args)
    if (a == "compile") return run_compile_bench(args);
  for (const std::string& a : args)
    if (a == "--all" || a == "precision" || a == "accumulation" || a == "prefetch" ||
        a == "metrics" || a == "checkpoint" || a == "flash" || a == "recompute" || a == "offload")
      return run_ablation_bench(args);
  for (const std::string& a : args) {
    if (a.rfind("--threads=", 0) == 0)
      omp_set_num_threads(std::stoi(a.substr(10)));
    else if (a.rfind("--", 0) != 0)
      what = a;
    else
      throw std::invalid_argument("unknown option " + a);
  }
  if (what != "machine" && what != "gemm" && what != "bandwidth" && what != "adamw")
    throw std::invalid_argument(
        "unknown benchmark '" + what +
        "' (one of: --all, precision, accumulation, prefetch, metrics, checkpoint, flash, compile, "
        "recompute, offload, "
        "attention, ddp, link, disk, offload-update, plan, tokenizer, machine, gemm, bandwidth, "
        "adamw)");
  if (what == "gemm" || what == "machine") bench_gemm();
  double triad = 0;
  if (what == "bandwidth" || what == "adamw" || what == "machine") triad = bench_triad();
  if (what == "adamw" || what == "machine") bench_adamw(triad);
  return 0;
}

}  // namespace kuai::app
