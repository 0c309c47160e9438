// The ablation harness (see ablation.h).
#include "kuai/train/ablation.h"

#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "kuai/backend/cpu/gemm/gemm_lowp.h"
#include "kuai/compile/passes.h"
#include "kuai/core/allocator.h"
#include "kuai/core/device.h"
#include "kuai/io/export.h"
#include "kuai/train/checkpoint.h"
#include "kuai/train/trainer.h"

namespace kuai::train {

double AblationRow::speedup() const {
  return on.step_ms_median > 0 ? off.step_ms_median / on.step_ms_median : 0.0;
}

double AblationRow::speedup_lo() const {
  return on.step_ms_max > 0 ? off.step_ms_min / on.step_ms_max : 0.0;
}

double AblationRow::speedup_hi() const {
  return on.step_ms_min > 0 ? off.step_ms_max / on.step_ms_min : 0.0;
}

bool AblationRow::within_noise() const {
  return off.step_ms_min <= on.step_ms_max && on.step_ms_min <= off.step_ms_max;
}

double AblationRow::memory_ratio() const {
  return off.peak_alloc_mib > 0 ? on.peak_alloc_mib / off.peak_alloc_mib : 0.0;
}

const std::vector<std::string>& ablation_techniques() {
  static const std::vector<std::string> t = {"precision", "accumulation", "prefetch",  "metrics",
                                             "flash",     "compile",      "recompute", "offload"};
  return t;
}

namespace {

constexpr int kAccum = 4;
constexpr int64_t kFlashMinT = 1024;  // the flash row's sequence length, at least
constexpr int kPrefetchWorkers = 2;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The base workload with everything that is not the measured step switched off.
TrainConfig quiet_config(const TrainConfig& base, const AblationOptions& o) {
  TrainConfig c = base;
  c.steps = o.steps;
  c.eval_every = 0;
  c.progress = "off";
  c.jsonl = false;
  c.tensorboard = false;
  c.save_weights = false;
  c.sync_every_step = false;
  c.log_every = std::max<int64_t>(1, o.steps);
  return c;
}

struct Arm {
  explicit Arm(const TrainConfig& c) : cfg(c) {}
  ArmStats stats;
  TrainConfig cfg;
  std::vector<double> figures;  // one per run
};

// One run of an arm: trains, keeps the steps after warm-up, records the arm's figure.
void run_arm(Arm& arm, const AblationOptions& o, const std::string& technique,
             std::ostream& progress) {
  Allocator::get().empty_cache();  // the previous arm's cached blocks must not count here
  malloc_trim(0);
  TrainOptions topts;
  topts.write_run_dir = false;
  topts.quiet = true;
  const TrainResult r = run_training(arm.cfg, progress, topts);
  const size_t skip = std::min<size_t>(static_cast<size_t>(o.warmup), r.step_ms.size());
  arm.stats.step_ms.insert(arm.stats.step_ms.end(), r.step_ms.begin() + skip, r.step_ms.end());
  // compile: the steady state (steps 2..N); its first step is an eager step that captures.
  const int64_t peak = technique == "compile" ? r.peak_alloc_steady_bytes : r.peak_alloc_bytes;
  arm.stats.peak_alloc_mib =
      std::max(arm.stats.peak_alloc_mib, static_cast<double>(peak) / (1 << 20));
  arm.stats.peak_rss_mib = std::max(arm.stats.peak_rss_mib,
                                    technique == "compile" ? r.rss_steady_max_mib : r.rss_max_mib);
  arm.stats.reserved_mib =
      std::max(arm.stats.reserved_mib, static_cast<double>(r.alloc_reserved_bytes) / (1 << 20));
  double figure = 0;
  if (technique == "accumulation" || technique == "precision" || technique == "flash") {
    figure = static_cast<double>(r.peak_alloc_bytes) / (1 << 20);
  } else if (technique == "prefetch") {
    std::vector<double> waits(r.data_wait_ms.begin() + skip, r.data_wait_ms.end());
    figure = median(waits);
  } else if (technique == "metrics") {
    figure = r.host_reads_per_step;  // counted by the trainer (core/host_reads.h)
  } else if (technique == "compile") {
    figure = r.minor_faults_per_step;
  } else if (technique == "recompute") {
    figure = static_cast<double>(step_peak_bytes(r)) / (1 << 20);
  } else if (technique == "offload") {
    figure = static_cast<double>(r.peak_alloc_bytes) / (1 << 20);
  }
  arm.figures.push_back(figure);
  arm.stats.round_ms.push_back(
      median(std::vector<double>(r.step_ms.begin() + skip, r.step_ms.end())));
  progress << fmt::format("  {:<28} round {}: median step {:.1f} ms\n", arm.stats.label,
                          arm.figures.size(), arm.stats.round_ms.back());
  progress.flush();
}

void finish(Arm& arm, double tokens_per_step) {
  arm.stats.config = arm.cfg;
  arm.stats.step_ms_median = median(arm.stats.step_ms);
  const auto [lo, hi] = std::minmax_element(arm.stats.round_ms.begin(), arm.stats.round_ms.end());
  if (lo != arm.stats.round_ms.end()) {
    arm.stats.step_ms_min = *lo;
    arm.stats.step_ms_max = *hi;
  }
  arm.stats.tokens_per_s =
      arm.stats.step_ms_median > 0 ? tokens_per_step / (arm.stats.step_ms_median / 1e3) : 0;
  arm.stats.figure = median(arm.figures);
}

}  // namespace

AblationRow run_ablation(const std::string& technique, const TrainConfig& base,
                         const AblationOptions& o, std::ostream& progress) {
  const auto& known = ablation_techniques();
  if (std::find(known.begin(), known.end(), technique) == known.end())
    throw std::invalid_argument(fmt::format(
        "unknown technique '{}' (one of: precision, accumulation, prefetch, metrics, flash, "
        "compile, recompute, offload)",
        technique));
  if (o.steps <= o.warmup) throw std::invalid_argument("--steps must exceed --warmup");
  TrainConfig q = quiet_config(base, o);
  if (technique == "flash" && q.model.seq_len < kFlashMinT) {
    // Long sequences are what flash attention is for: the workload's model at T = 1024, with
    // the batch cut so that a step holds as many tokens as before.
    q.batch_size = std::max<int64_t>(1, q.batch_size * q.model.seq_len / kFlashMinT);
    q.model.seq_len = kFlashMinT;
  }
  AblationRow row;
  row.technique = technique;
  Arm off(q), on(q);
  std::vector<Arm> extra;
  progress << fmt::format("bench {}: {} steps per run ({} dropped), {} rounds\n", technique,
                          o.steps, o.warmup, o.rounds);

  if (technique == "precision") {
    off.cfg.precision = "fp32";
    on.cfg.precision = "bf16";
    Arm fp16(q);
    fp16.cfg.precision = "fp16";
    off.stats.label = "fp32";
    on.stats.label = "bf16 autocast";
    fp16.stats.label = "fp16 autocast + loss scaling";
    extra.push_back(fp16);
    row.figure_name = "allocator peak MiB";
    row.claim = "mixed precision trains 1.5-2x faster in about half the activation memory";
    row.claim_speedup_lo = 1.5;
    row.claim_speedup_hi = 2.0;
    row.claim_memory_lo = row.claim_memory_hi = 0.5;
  } else if (technique == "accumulation") {
    if (q.batch_size % kAccum != 0)
      throw std::invalid_argument(fmt::format(
          "bench accumulation: train.batch_size {} is not a multiple of {}", q.batch_size, kAccum));
    off.cfg.accum_steps = 1;
    on.cfg.batch_size = q.batch_size / kAccum;
    on.cfg.accum_steps = kAccum;
    off.stats.label = fmt::format("batch {}", q.batch_size);
    on.stats.label = fmt::format("{} x micro-batch {}", kAccum, on.cfg.batch_size);
    row.figure_name = "allocator peak MiB";
    row.claim = fmt::format("same effective batch in about 1/{} of the activation memory", kAccum);
    row.claim_speedup_lo = row.claim_speedup_hi = 1.0;
    row.claim_memory_lo = row.claim_memory_hi = 1.0 / kAccum;
  } else if (technique == "prefetch") {
    // Calibrate the slow loader: half a step of the instant loader's median.
    Arm calib(q);
    calib.cfg.workers = 0;
    calib.cfg.delay_ms = 0;
    calib.stats.label = "calibration (instant loader)";
    run_arm(calib, o, technique, progress);
    finish(calib, 1);
    const double delay = 0.5 * calib.stats.step_ms_median;
    off.cfg.workers = 0;
    on.cfg.workers = kPrefetchWorkers;
    off.cfg.delay_ms = on.cfg.delay_ms = delay;
    off.stats.label = fmt::format("0 workers, {:.0f} ms/batch loader", delay);
    on.stats.label = fmt::format("{} workers, {:.0f} ms/batch loader", kPrefetchWorkers, delay);
    Arm instant(q);
    instant.cfg.workers = 0;
    instant.cfg.delay_ms = 0;
    instant.stats.label = "instant loader";
    extra.push_back(instant);
    row.figure_name = "data wait ms/step";
    row.claim = "worker threads hide loading: step time as with an instant loader";
  } else if (technique == "flash") {
    off.cfg.attention = "naive";
    on.cfg.attention = "flash";
    off.stats.label = fmt::format("naive attention, T {}", q.model.seq_len);
    on.stats.label = fmt::format("flash attention, T {}", q.model.seq_len);
    row.figure_name = "allocator peak MiB";
    row.claim =
        "FlashAttention: 2-4x faster attention, 10-20x less attention memory at T 2k-4k "
        "(GPU papers)";
    row.claim_speedup_lo = 2.0;  // of attention alone: an upper bound for the whole step
    row.claim_speedup_hi = 4.0;
  } else if (technique == "compile") {
    off.cfg.compile = false;
    on.cfg.compile = true;
    off.stats.label = "eager";
    on.stats.label = "compiled (captured, planned, replayed)";
    // The pass-by-pass ablation: the compiled step with each pass off in turn.
    for (const std::string& pass : compiler::PassOptions::names()) {
      Arm without(q);
      without.cfg.compile = true;
      without.cfg.compile_disable = pass;
      without.stats.label = "compiled without " + pass;
      extra.push_back(without);
    }
    row.figure_name = "minor page faults per step";
    row.claim = "torch.compile: 10-20% faster training";
    row.claim_speedup_lo = 1.10;
    row.claim_speedup_hi = 1.20;
  } else if (technique == "recompute") {
    off.cfg.recompute = "none";
    on.cfg.recompute = "full";
    Arm selective(q);
    selective.cfg.recompute = "selective";
    off.stats.label = "no recomputation";
    on.stats.label = "full recomputation (block inputs kept)";
    selective.stats.label = "selective recomputation (products kept)";
    extra.push_back(selective);
    row.figure_name = "step peak above its start, MiB";
    row.claim =
        "full recomputation: activation memory of one block per layer for ~1/3 more compute; "
        "selective: most of the saving for a few percent (Korthikanti et al.)";
    row.claim_speedup_lo = 1.0 / 1.4;  // the bars: full <= 1.4x time
    row.claim_speedup_hi = 1.0 / 1.3;
  } else if (technique == "offload") {
    off.cfg.offload = "none";
    on.cfg.offload = "disk";
    off.stats.label = "AdamW's moments in memory";
    on.stats.label = fmt::format("moments offloaded to disk ({} MiB chunks)", q.offload_chunk_mb);
    row.figure_name = "allocator peak of live tensors, MiB";
    row.claim =
        "offloading optimizer state takes LLaMA-7B's training memory from 42 GB to 26 GB (the "
        "moments leave the memory that trains)";
  } else {  // metrics: the same log_every in both arms; only the per-step read differs
    off.cfg.sync_every_step = true;
    on.cfg.sync_every_step = false;
    off.stats.label = "loss.item() every step";
    on.stats.label = "device ring, read by the logger";
    row.figure_name = "host reads in the step loop per step";
    row.claim = "no per-step .item(): the step loop never waits for the device";
  }

  // ABBA across rounds: off, on, references; then references, on, off; ...
  std::vector<Arm*> order = {&off, &on};
  for (Arm& e : extra) order.push_back(&e);
  for (int64_t r = 0; r < o.rounds; ++r) {
    if (r % 2 == 0)
      for (Arm* a : order) run_arm(*a, o, technique, progress);
    else
      for (auto a = order.rbegin(); a != order.rend(); ++a) run_arm(**a, o, technique, progress);
  }
  const auto tokens = [](const TrainConfig& c) {
    return static_cast<double>(c.batch_size * c.model.seq_len * c.accum_steps);
  };
  finish(off, tokens(off.cfg));
  finish(on, tokens(on.cfg));
  for (Arm& e : extra) finish(e, tokens(e.cfg));
  row.off = off.stats;
  row.on = on.stats;
  for (Arm& e : extra) row.extra.push_back(e.stats);

  // A ratio whose arms' rounds overlap is not a measured gain or loss.
  const std::string noise =
      row.within_noise() ? fmt::format("within noise (off {:.1f}-{:.1f} ms, on {:.1f}-{:.1f} ms)",
                                       row.off.step_ms_min, row.off.step_ms_max, row.on.step_ms_min,
                                       row.on.step_ms_max)
                         : "";
  if (technique == "prefetch")  // the advice: as fast as with an instant loader
    row.claim_speedup_lo = row.claim_speedup_hi =
        row.off.step_ms_median / std::max(1e-9, row.extra[0].step_ms_median);
  if (technique == "precision") {
    const ArmStats& h = row.extra[0];
    row.verdict = fmt::format(
        "bf16: step {}, allocator peak x{:.2f}; fp16: step x{:.2f}, peak x{:.2f}; {}",
        noise.empty() ? fmt::format("x{:.2f}", 1.0 / std::max(1e-9, row.speedup())) : noise,
        row.memory_ratio(), h.step_ms_median / std::max(1e-9, row.off.step_ms_median),
        h.peak_alloc_mib / std::max(1e-9, row.off.peak_alloc_mib),
        cpu::cpu_has_native_bf16()
            ? "bf16 GEMMs on this CPU's bf16 units (oneDNN)"
            : "no bf16/fp16 arithmetic on this CPU: fp32 math, low-precision storage");
  } else if (technique == "flash") {
    row.verdict = fmt::format(
        "{}, allocator peak x{:.2f} (B {}, T {})",
        noise.empty() ? fmt::format("{:.2f}x faster step", row.speedup()) : "step " + noise,
        row.memory_ratio(), q.batch_size, q.model.seq_len);
  } else if (technique == "accumulation") {
    row.verdict = fmt::format(
        "allocator peak x{:.2f}, step time {}", row.memory_ratio(),
        noise.empty() ? fmt::format("x{:.2f}", 1.0 / std::max(1e-9, row.speedup())) : noise);
  } else if (technique == "prefetch") {
    const double vs_instant = row.on.step_ms_median / std::max(1e-9, row.extra[0].step_ms_median);
    row.verdict = fmt::format(
        "{}; data wait {:.2f} ms = {:.1f}% of the step; step x{:.2f} of the instant loader's",
        noise.empty() ? fmt::format("{:.2f}x faster", row.speedup()) : noise, row.on.figure,
        100.0 * row.on.figure / std::max(1e-9, row.on.step_ms_median), vs_instant);
  } else if (technique == "compile") {
    std::string passes;
    for (const ArmStats& e : row.extra)
      passes += fmt::format("; {} x{:.3f} of eager", e.label,
                            row.off.step_ms_median / std::max(1e-9, e.step_ms_median));
    row.verdict = fmt::format(
        "{}; steps 2..N: allocator peak of live tensors x{:.2f}, allocator reserved {:.1f} -> "
        "{:.1f} MiB, resident set {:.0f} -> {:.0f} MiB, minor page faults per step {:.1f} -> "
        "{:.1f}{}",
        noise.empty() ? fmt::format("{:.3f}x faster step", row.speedup()) : "step " + noise,
        row.memory_ratio(), row.off.reserved_mib, row.on.reserved_mib, row.off.peak_rss_mib,
        row.on.peak_rss_mib, row.off.figure, row.on.figure, passes);
  } else if (technique == "offload") {
    const double params = [&] {
      const DeviceGuard meta(kMeta);  // shapes only
      return double(nn::GPT(q.model, 0).num_parameters());
    }();
    row.verdict = fmt::format(
        "allocator peak x{:.2f} ({:.0f} -> {:.0f} MiB: {:.1f} -> {:.1f} B/param), resident set "
        "{:.0f} -> {:.0f} MiB; step time x{:.2f}{} (the update streams {:.0f} MiB of moments "
        "through the disk each step)",
        row.memory_ratio(), row.off.peak_alloc_mib, row.on.peak_alloc_mib,
        row.off.peak_alloc_mib * (1 << 20) / params, row.on.peak_alloc_mib * (1 << 20) / params,
        row.off.peak_rss_mib, row.on.peak_rss_mib,
        row.on.step_ms_median / std::max(1e-9, row.off.step_ms_median),
        noise.empty() ? "" : "; " + noise, 16.0 * params / (1 << 20));
  } else if (technique == "recompute") {
    const ArmStats& sel = row.extra[0];
    const auto ratio = [](double a, double b) { return a / std::max(1e-9, b); };
    row.verdict = fmt::format(
        "step peak above its start (activations, gradients, scratch): full x{:.2f}, selective "
        "x{:.2f} of none's {:.0f} MiB; step time: full x{:.2f}, selective x{:.2f}{} ({} attention, "
        "B {}, T {}, {})",
        ratio(row.on.figure, row.off.figure), ratio(sel.figure, row.off.figure), row.off.figure,
        ratio(row.on.step_ms_median, row.off.step_ms_median),
        ratio(sel.step_ms_median, row.off.step_ms_median), noise.empty() ? "" : "; " + noise,
        q.attention, q.batch_size, q.model.seq_len, q.precision);
  } else {
    row.verdict = fmt::format(
        "{}; host reads per step {:.0f} -> {:.0f} (counted): on the CPU device a read waits for "
        "nothing, so there is nothing to gain here; on an accelerator each read stalls the queue",
        noise.empty() ? fmt::format("{:.3f}x", row.speedup()) : noise, row.off.figure,
        row.on.figure);
  }
  return row;
}

CheckpointBench run_checkpoint_bench(const TrainConfig& base, int64_t rounds,
                                     const std::string& scratch_dir, std::ostream& progress) {
  namespace fs = std::filesystem;
  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto dir_bytes = [](const std::string& d) {
    uintmax_t n = 0;
    for (const auto& e : fs::recursive_directory_iterator(d))
      if (e.is_regular_file()) n += e.file_size();
    return static_cast<double>(n);
  };
  nn::GPT model(base.model, static_cast<uint64_t>(base.seed));
  optim::AdamW opt(param_groups(model, static_cast<float>(base.weight_decay)), {});
  opt.ensure_state();  // the moments exist, as after the first step
  CheckpointBench c;
  c.rounds = rounds;
  c.model = fmt::format("{}, vocab {} ({:.2f}M parameters)", nn::describe(base.model),
                        base.model.vocab_size, static_cast<double>(model.num_parameters()) / 1e6);
  fs::remove_all(scratch_dir);
  fs::create_directories(scratch_dir);
  std::vector<double> exp_ms, sync_ms, async_blocked, async_total;
  const TrainingState state{1, {}, static_cast<uint64_t>(base.seed), to_toml(base), {}};
  TrainingState second = state;  // the timed save: one step later
  second.step = 2;
  for (int64_t r = 0; r < rounds; ++r) {
    const std::string export_path = scratch_dir + "/weights.safetensors";
    auto t0 = Clock::now();
    io::export_weights(export_path, model, {});
    exp_ms.push_back(ms_since(t0));
    c.export_mib = static_cast<double>(fs::file_size(export_path)) / (1 << 20);
    // Steady state, as in training: each Checkpointer saves once to warm its snapshot buffers,
    // then the second save is timed.
    {
      Checkpointer sync(scratch_dir + "/sync", 1, /*async=*/false);
      sync.save(model, opt, state);
      t0 = Clock::now();
      sync.save(model, opt, second);
      sync_ms.push_back(ms_since(t0));
      c.full_mib = dir_bytes(sync.last_stats().path) / (1 << 20);
    }
    {
      Checkpointer async(scratch_dir + "/async", 1, /*async=*/true);
      async.save(model, opt, state);
      async.wait();
      t0 = Clock::now();
      async_blocked.push_back(async.save(model, opt, second));
      async.wait();
      async_total.push_back(ms_since(t0));
    }
    progress << fmt::format(
        "  checkpoint round {}: export {:.1f} ms, full sync {:.1f} ms, full async blocked {:.2f} "
        "ms of {:.1f} ms\n",
        r + 1, exp_ms.back(), sync_ms.back(), async_blocked.back(), async_total.back());
    progress.flush();
  }
  fs::remove_all(scratch_dir);
  c.export_ms = median(exp_ms);
  c.full_sync_ms = median(sync_ms);
  c.full_async_blocked_ms = median(async_blocked);
  c.full_async_total_ms = median(async_total);
  return c;
}

std::string checkpoint_markdown(const CheckpointBench& c) {
  return fmt::format(
      "| checkpoint ({}) | size MiB | save ms (blocks the step) | save ms (total) |\n"
      "|---|---|---|---|\n"
      "| weights-only export, fp32 | {:.1f} | {:.1f} | {:.1f} |\n"
      "| full (model + AdamW m, v + state), synchronous | {:.1f} | {:.1f} | {:.1f} |\n"
      "| full, asynchronous (snapshot, then a writer thread) | {:.1f} | {:.2f} | {:.1f} |\n"
      "\nThe advice says: \"{}\". Measured: full / weights-only = {:.2f}x the size and {:.2f}x the "
      "time; the asynchronous save blocks the step for {:.1f}% of the synchronous save's time "
      "(medians of {} rounds). Only the full checkpoint resumes training exactly.\n",
      c.model, c.export_mib, c.export_ms, c.export_ms, c.full_mib, c.full_sync_ms, c.full_sync_ms,
      c.full_mib, c.full_async_blocked_ms, c.full_async_total_ms, c.claim, c.size_ratio(),
      c.time_ratio(), 100.0 * c.async_share(), c.rounds);
}

std::string ablation_markdown(const std::vector<AblationRow>& rows) {
  std::string s =
      "| technique | off | on | step ms off / on (min-max of rounds) | speedup | tokens/s on | "
      "allocator peak MiB off / on | peak RSS MiB off / on | own figure off / on | the advice "
      "says | measured |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const AblationRow& r : rows)
    s += fmt::format(
        "| {} | {} | {} | {:.1f} ({:.1f}-{:.1f}) / {:.1f} ({:.1f}-{:.1f}) | {} | {:.0f} | {:.1f} / "
        "{:.1f} ({:.2f}) | {:.0f} / {:.0f} | {}: {:.2f} / {:.2f} | {} | {} |\n",
        r.technique, r.off.label, r.on.label, r.off.step_ms_median, r.off.step_ms_min,
        r.off.step_ms_max, r.on.step_ms_median, r.on.step_ms_min, r.on.step_ms_max,
        r.within_noise()
            ? std::string("within noise")
            : fmt::format("{:.3f}x ({:.2f}-{:.2f})", r.speedup(), r.speedup_lo(), r.speedup_hi()),
        r.on.tokens_per_s, r.off.peak_alloc_mib, r.on.peak_alloc_mib, r.memory_ratio(),
        r.off.peak_rss_mib, r.on.peak_rss_mib, r.figure_name, r.off.figure, r.on.figure, r.claim,
        r.verdict);
  return s;
}

namespace {
nlohmann::json arm_json(const ArmStats& a) {
  return {{"label", a.label},
          {"step_ms_median", a.step_ms_median},
          {"step_ms_min", a.step_ms_min},
          {"step_ms_max", a.step_ms_max},
          {"round_ms", a.round_ms},
          {"tokens_per_s", a.tokens_per_s},
          {"peak_alloc_mib", a.peak_alloc_mib},
          {"peak_rss_mib", a.peak_rss_mib},
          {"allocator_reserved_mib", a.reserved_mib},
          {"figure", a.figure},
          {"step_ms", a.step_ms}};
}
}  // namespace

std::string ablation_json(const std::vector<AblationRow>& rows, const TrainConfig& base,
                          const AblationOptions& o, const CheckpointBench* ck) {
  nlohmann::json j;
  j["config"] = to_toml(base);
  j["steps_per_run"] = o.steps;
  j["warmup_steps_dropped"] = o.warmup;
  j["rounds"] = o.rounds;
  j["rows"] = nlohmann::json::array();
  for (const AblationRow& r : rows) {
    nlohmann::json row = {{"technique", r.technique},
                          {"figure_name", r.figure_name},
                          {"claim", r.claim},
                          {"verdict", r.verdict},
                          {"speedup", r.speedup()},
                          {"memory_ratio", r.memory_ratio()},
                          {"speedup_min", r.speedup_lo()},
                          {"speedup_max", r.speedup_hi()},
                          {"within_noise", r.within_noise()},
                          {"claimed_speedup", {r.claim_speedup_lo, r.claim_speedup_hi}},
                          {"claimed_memory_ratio", {r.claim_memory_lo, r.claim_memory_hi}},
                          {"off", arm_json(r.off)},
                          {"on", arm_json(r.on)}};
    for (const ArmStats& e : r.extra) row["reference"].push_back(arm_json(e));
    j["rows"].push_back(row);
  }
  if (ck)
    j["checkpoint"] = {{"model", ck->model},
                       {"export_mib", ck->export_mib},
                       {"full_mib", ck->full_mib},
                       {"export_ms", ck->export_ms},
                       {"full_sync_ms", ck->full_sync_ms},
                       {"full_async_blocked_ms", ck->full_async_blocked_ms},
                       {"full_async_total_ms", ck->full_async_total_ms},
                       {"size_ratio", ck->size_ratio()},
                       {"time_ratio", ck->time_ratio()},
                       {"async_blocked_share", ck->async_share()},
                       {"claim", ck->claim},
                       {"rounds", ck->rounds}};
  return j.dump(2) + "\n";
}

namespace {
std::string xml_escape(const std::string& in) {
  std::string out;
  for (char ch : in) {
    if (ch == '&')
      out += "&amp;";
    else if (ch == '<')
      out += "&lt;";
    else if (ch == '>')
      out += "&gt;";
    else
      out += ch;
  }
  return out;
}
}  // namespace

std::string ablation_svg(const std::vector<AblationRow>& rows, const std::string& machine) {
  // Per technique on one axis: the speedup (off/on median step time) with a whisker over the
  // rounds' spread (off min / on max .. off max / on min), grey and labelled "within noise" when
  // the arms' ranges overlap; the allocator peak ratio (on/off); beside each, in green, the range
  // the advice claims (a tick when it names one value). A dashed line marks 1.0 (no change).
  const int left = 150, width = 420, bar_h = 14, claim_h = 5, gap = 12, top = 48;
  const int row_h = 2 * (bar_h + claim_h + 2) + gap;
  double max_v = 1.5;
  for (const AblationRow& r : rows)
    max_v =
        std::max({max_v, r.speedup_hi(), r.memory_ratio(), r.claim_speedup_hi, r.claim_memory_hi});
  max_v = std::ceil(max_v * 2.0) / 2.0;
  const int height = top + static_cast<int>(rows.size()) * row_h + 56;
  auto x_of = [&](double v) {
    return left + static_cast<int>(std::lround(std::clamp(v, 0.0, max_v) / max_v * width));
  };
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"10\" y=\"20\" font-size=\"14\">kuai bench: what each technique buys here</text>\n"
      "<text x=\"10\" y=\"36\" font-size=\"11\">{}</text>\n",
      left + width + 150, height, xml_escape(machine.empty() ? "this machine" : machine));
  auto claim = [&](double lo, double hi, int y) {
    if (hi <= 0) return std::string();
    if (hi - lo < 1e-9)
      return fmt::format("<rect x=\"{}\" y=\"{}\" width=\"3\" height=\"{}\" fill=\"#2a9d4b\"/>",
                         x_of(lo) - 1, y, claim_h);
    return fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#2a9d4b\"/>",
                       x_of(lo), y, std::max(2, x_of(hi) - x_of(lo)), claim_h);
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    const AblationRow& r = rows[i];
    const int y = top + static_cast<int>(i) * row_h;
    const bool noise = r.within_noise();
    s += fmt::format("<text x=\"10\" y=\"{}\">{}</text>\n", y + bar_h + 4, r.technique);
    const int xs = x_of(r.speedup());
    s += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\"/>"
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>"
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>"
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>"
        "<text x=\"{}\" y=\"{}\">{}</text>\n",
        left, y, std::max(1, xs - left), bar_h, noise ? "#a0a0a0" : "#3b7dd8",
        // whisker: the spread of the ratio over the rounds
        x_of(r.speedup_lo()), y + bar_h / 2, x_of(r.speedup_hi()), y + bar_h / 2,
        x_of(r.speedup_lo()), y + 3, x_of(r.speedup_lo()), y + bar_h - 3, x_of(r.speedup_hi()),
        y + 3, x_of(r.speedup_hi()), y + bar_h - 3, std::max(xs, x_of(r.speedup_hi())) + 4, y + 11,
        noise ? fmt::format("within noise ({:.2f}-{:.2f}x)", r.speedup_lo(), r.speedup_hi())
              : fmt::format("speedup {:.2f}x ({:.2f}-{:.2f})", r.speedup(), r.speedup_lo(),
                            r.speedup_hi()));
    s += claim(r.claim_speedup_lo, r.claim_speedup_hi, y + bar_h + 1) + "\n";
    const int ym = y + bar_h + claim_h + 4;
    s += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#e0892b\"/>"
        "<text x=\"{}\" y=\"{}\">memory x{:.2f}</text>\n",
        left, ym, std::max(1, x_of(r.memory_ratio()) - left), bar_h, x_of(r.memory_ratio()) + 4,
        ym + 11, r.memory_ratio());
    s += claim(r.claim_memory_lo, r.claim_memory_hi, ym + bar_h + 1) + "\n";
  }
  const int axis_y = top + static_cast<int>(rows.size()) * row_h;
  s += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"black\" "
      "stroke-dasharray=\"4 3\"/>\n<text x=\"{0}\" y=\"{3}\" text-anchor=\"middle\">1.0</text>\n",
      x_of(1.0), top - 6, axis_y, axis_y + 14);
  s += fmt::format(
      "<text x=\"10\" y=\"{}\" font-size=\"11\">blue: off/on median step time (higher is "
      "faster), whisker: min-max over rounds, grey: within noise; orange: on/off allocator peak "
      "(lower is smaller)</text>\n"
      "<text x=\"10\" y=\"{}\" font-size=\"11\">green, under each bar: what the advice claims "
      "(flash: of attention alone; prefetch: the instant loader's step)</text>\n</svg>\n",
      axis_y + 32, axis_y + 46);
  return s;
}

}  // namespace kuai::train
