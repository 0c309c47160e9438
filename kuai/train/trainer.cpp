// The training loop (see trainer.h).
#include "kuai/train/trainer.h"

#include "kuai/train/step_parts.h"
#include "kuai/train/train_step.h"

#include <fmt/format.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>

#include "kuai/amp/autocast.h"
#include "kuai/amp/grad_scaler.h"
#include "kuai/compile/compile.h"
#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/host_reads.h"
#include "kuai/core/ops.h"
#include "kuai/core/profiler.h"
#include "kuai/data/batch_source.h"
#include "kuai/data/loader.h"
#include "kuai/data/prepare.h"
#include "kuai/data/token_file.h"
#include "kuai/distributed/ddp.h"
#include "kuai/distributed/zero.h"
#include "kuai/io/export.h"
#include "kuai/io/hf_llama.h"
#include "kuai/io/tensor_io.h"
#include "kuai/log/metrics.h"
#include "kuai/log/sinks.h"
#include "kuai/nn/layers.h"
#include "kuai/nn/optimize.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/clip_grad.h"
#include "kuai/optim/schedule.h"
#include "kuai/plan/costs.h"
#include "kuai/train/checkpoint.h"

namespace kuai::train {

double peak_rss_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;
}

int64_t minor_faults() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

double current_rss_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0.0;
  return static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

double learning_rate(const TrainConfig& cfg, int64_t step) {
  return optim::warmup_cosine_lr(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio, step);
}

int64_t step_peak_bytes(const TrainResult& r) {
  return r.peak_alloc_steady_bytes > 0 ? r.peak_alloc_steady_bytes - r.step_start_bytes : 0;
}

std::string result_line(const TrainResult& r) {
  return fmt::format(
      "RESULT tokens_per_s={:.1f} step_ms_median={:.2f} peak_rss_mib={:.1f} final_loss={:.4f} "
      "host_reads_per_step={:.3g} comm_mib_per_step={:.3f} overlap={:.3f} "
      "minor_faults_per_step={:.1f} peak_alloc_mib={:.1f} overlap_time={:.3f} "
      "comm_ms_per_step={:.2f} step_peak_mib={:.1f} gather_wait_ms_per_step={:.2f} "
      "comm_bytes_sent={}",
      r.tokens_per_s, r.step_ms_median, r.peak_rss_mib, r.final_loss, r.host_reads_per_step,
      r.comm_mib_per_step, r.overlap, r.minor_faults_per_step,
      static_cast<double>(r.peak_alloc_bytes) / (1 << 20), r.overlap_time, r.comm_ms_per_step,
      static_cast<double>(step_peak_bytes(r)) / (1 << 20), r.gather_wait_ms_per_step,
      fmt::join(r.comm_bytes_sent_by_rank, ","));
}

Tensor forward_backward(const nn::GPT& model, const Tensor& x, const Tensor& y, float loss_scale) {
  return scaled_backward(model.loss(x, y), loss_scale);
}

Tensor forward_backward(const nn::GPT& model, const Tensor& x, const Tensor& y,
                        const Tensor& loss_scale) {
  return scaled_backward(model.loss(x, y), loss_scale);
}

namespace {

std::atomic<bool> g_stop{false};

extern "C" void on_sigint(int) {
  g_stop.store(true);
  std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C ends the process as usual
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

struct Sources {
  std::shared_ptr<const data::BatchSource> train, val;  // val may be null
};

// Training windows from the head of the token file, held-out windows from its tail
// (data.val_fraction); synthetic data draws uniform tokens for both.
Sources make_sources(const TrainConfig& cfg, int rank, int world) {
  const int64_t B = cfg.batch_size, T = cfg.model.seq_len, V = cfg.model.vocab_size;
  const auto seed = static_cast<uint64_t>(cfg.seed);
  Sources s;
  if (cfg.data_source == "synthetic") {
    s.train = std::make_shared<data::SyntheticTokens>(V, B, T, seed, rank, world);
    if (cfg.val_fraction > 0)
      s.val = std::make_shared<data::SyntheticTokens>(V, B, T, seed + 1, rank, world);
    return s;
  }
  auto file = std::make_shared<const data::TokenFile>(data::TokenFile::open(cfg.data_path));
  if (file->vocab_bound() > V)
    throw std::runtime_error(fmt::format("{}: token ids reach {} but model.vocab_size is {}",
                                         cfg.data_path, file->vocab_bound() - 1, V));
  const int64_t n = file->size();
  const int64_t val_tokens =
      cfg.val_fraction > 0 ? static_cast<int64_t>(std::llround(cfg.val_fraction * n)) : 0;
  const int64_t split = n - val_tokens;
  if (split < T + 2)
    throw std::runtime_error(
        fmt::format("{}: {} training tokens (after data.val_fraction = {}) is fewer than "
                    "model.seq_len + 2 = {}",
                    cfg.data_path, split, cfg.val_fraction, T + 2));
  if (val_tokens > 0 && val_tokens < T + 2)
    throw std::runtime_error(
        fmt::format("{}: the held-out split (data.val_fraction = {}) has {} tokens, fewer than "
                    "model.seq_len + 2 = {}; raise data.val_fraction or set it to 0",
                    cfg.data_path, cfg.val_fraction, val_tokens, T + 2));
  s.train = std::make_shared<data::RandomWindows>(file, 0, split, B, T, seed, rank, world);
  if (val_tokens > 0)
    s.val = std::make_shared<data::SequentialWindows>(file, split, n, B, T, rank, world);
  return s;
}

// Mean loss over the first `batches` held-out batches (always the same ones), on the device.
Tensor evaluate(const nn::GPT& model, const data::BatchSource& src, int64_t batches,
                DType compute) {
  autograd::NoGradGuard no_grad;
  amp::AutocastGuard amp(compute != DType::kF32, compute);
  const int64_t B = src.batch_size(), T = src.seq_len();
  Tensor x = Tensor::empty({B, T}, DType::kI32), y = Tensor::empty({B, T}, DType::kI32);
  std::vector<int32_t> hx(static_cast<size_t>(B * T)), hy(hx.size());  // host side
  Tensor total;
  for (int64_t i = 0; i < batches; ++i) {
    src.fill(i, hx.data(), hy.data());
    x.copy_from_host(hx.data(), hx.size() * sizeof(int32_t));
    y.copy_from_host(hy.data(), hy.size() * sizeof(int32_t));
    Tensor l = model.loss(x, y);
    total = total.defined() ? add(total, l) : l;
  }
  return scale(total, 1.0f / static_cast<float>(batches)).detach();
}

// A scalar averaged over the ranks (itself when alone).
Tensor mean_over_ranks(dist::ProcessGroup& group, const Tensor& x) {
  if (group.size() == 1) return x;
  Tensor t = contiguous(reshape(x, {1}));
  group.all_reduce(t, dist::ReduceOp::kAvg)->wait();
  return reshape(t, {});
}

std::vector<std::unique_ptr<log::MetricSink>> make_sinks(const TrainConfig& cfg,
                                                         const TrainOptions& opts,
                                                         std::ostream& out,
                                                         const std::string& run_path,
                                                         bool resuming) {
  std::vector<std::unique_ptr<log::MetricSink>> sinks;
  log::ConsoleMode mode = log::ConsoleMode::kPlain;
  if (cfg.progress == "off" || opts.quiet)
    mode = log::ConsoleMode::kOff;
  else if (cfg.progress == "bar" || (cfg.progress == "auto" && opts.terminal))
    mode = log::ConsoleMode::kBar;
  sinks.push_back(std::make_unique<log::ConsoleSink>(out, mode, cfg.steps, cfg.log_every));
  if (!run_path.empty() && cfg.jsonl)
    sinks.push_back(std::make_unique<log::JsonlSink>(run_path + "/metrics.jsonl", resuming));
  if (!run_path.empty() && cfg.tensorboard)
    sinks.push_back(std::make_unique<log::TensorBoardSink>(run_path));
  return sinks;
}

io::ExportOptions export_options(const TrainConfig& cfg, int64_t step) {
  io::ExportOptions o;
  o.dtype = cfg.export_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  o.step = step;
  o.tokenizer = data::tokenizer_for_vocab(cfg.model.vocab_size);
  return o;
}

// The tokenizer.json of the run's ids, kept as <run>/tokenizer.json so that its exports carry it:
// the one `kuai prepare` wrote beside the token file, else the one of the Hugging Face model the
// run starts from. None: the run's ids are bytes or GPT-2's (by vocabulary size, as before).
void copy_run_tokenizer(const TrainConfig& cfg, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  fs::path source;
  if (cfg.data_source == "file" && fs::is_regular_file(data::tokenizer_file_of(cfg.data_path)))
    source = data::tokenizer_file_of(cfg.data_path);
  else if (!cfg.init_hf.empty() && fs::is_regular_file(fs::path(cfg.init_hf) / "tokenizer.json"))
    source = fs::path(cfg.init_hf) / "tokenizer.json";
  const fs::path target = dir / "tokenizer.json";
  if (source.empty()) {
    fs::remove(target);  // an earlier run's under this name
    return;
  }
  const fs::path tmp = dir / "tokenizer.json.tmp";
  fs::copy_file(source, tmp, fs::copy_options::overwrite_existing);
  fs::rename(tmp, target);
}

std::string prepare_run_dir(const TrainConfig& cfg, bool resuming) {
  const std::filesystem::path dir = std::filesystem::path(cfg.run_dir) / cfg.run_name;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error(
        fmt::format("{}: cannot create run directory: {}", dir.string(), ec.message()));
  // A rerun under the same name starts fresh logs (old event files would mix into the charts);
  // a resumed run continues them.
  if (!resuming)
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0)
        std::filesystem::remove(entry.path());
  std::ofstream(dir / "config.toml") << to_toml(cfg);
  copy_run_tokenizer(cfg, dir);
  return dir.string();
}

// Under `kuai launch` (KUAI_LAUNCH_STATUS names a file): the first step this process completed,
// so that the launcher tells a job that failed before any progress from one that trained.
void report_first_step(int64_t step) {
  const char* path = std::getenv("KUAI_LAUNCH_STATUS");
  if (path == nullptr || *path == '\0') return;
  std::ofstream(path, std::ios::trunc) << fmt::format("first_step {}\n", step);
}

}  // namespace

const std::atomic<bool>* install_sigint_stop() {
  g_stop.store(false);
  std::signal(SIGINT, on_sigint);
  return &g_stop;
}

TrainResult run_training(const TrainConfig& cfg, std::ostream& out, const TrainOptions& options) {
  if (cfg.threads > 0) omp_set_num_threads(static_cast<int>(cfg.threads));
  // Technique 2: the ranks of the run. Ranks other than 0 write nothing and print nothing.
  const std::shared_ptr<dist::ProcessGroup> group =
      options.group ? options.group : dist::default_process_group({cfg.timeout_s});
  const int rank = group->rank(), world = group->size();
  TrainOptions opts = options;
  if (rank != 0) {
    opts.write_run_dir = false;
    opts.quiet = true;
  }
  const int64_t B = cfg.batch_size, T = cfg.model.seq_len, V = cfg.model.vocab_size;
  const int64_t k = cfg.accum_steps;
  const DType compute = amp::precision_dtype(cfg.precision);
  const Sources sources = make_sources(cfg, rank, world);

  // The step's parts (step_parts.h): the model, DDP, AdamW or ZeRO's, the scaler, the TrainStep.
  StepOptions so = step_options(cfg);
  so.log = [&out, quiet = opts.quiet](const std::string& m) {
    if (quiet) return;
    if (m.rfind("train.compile: not applied", 0) == 0)
      out << m << "\n";
    else
      out << "\n" << m << "\n";
  };
  // Fine-tuning from a Hugging Face LLaMA (not when resuming: the checkpoint has the weights):
  // every rank reads it (DDP would broadcast rank 0's); ZeRO-3 fills each rank's shards from it
  // one parameter at a time, its model having no values to load into.
  const std::string init_hf = opts.resume.empty() ? cfg.init_hf : std::string();
  const std::unique_ptr<StepParts> parts = build_step_parts(
      cfg, group, so,
      [&](nn::GPT& m) {
        if (!init_hf.empty() && cfg.zero != 3) io::load_hf(init_hf, m);
      },
      init_hf);
  if (options.built) options.built(*parts);
  nn::GPT& model = static_cast<nn::GPT&>(*parts->model);
  std::optional<dist::DistributedDataParallel>& ddp = parts->ddp;
  std::unique_ptr<optim::AdamW>& adamw = parts->adamw;
  std::unique_ptr<dist::ZeroAdamW>& zero = parts->zero;
  // What a checkpoint saves of the optimizer on this rank (and restores into it).
  auto opt_shard = [&]() {
    if (zero) return optimizer_shard(model, *zero);
    if (parts->offloaded) return optimizer_shard(model, *parts->offloaded);
    return optimizer_shard(model, *adamw);
  };
  const std::vector<Tensor> params = model.parameters();
  amp::GradScaler& scaler = *parts->scaler;
  optim::Optimizer& opt = parts->optimizer();
  const nn::AttentionImpl attention = nn::parse_attention_impl(cfg.attention);

  TrainResult result;
  // A weights-only export (rank 0 writes it), the masters streamed from their files when they are
  // offloaded: under ZeRO a collective, rank 0 gathering every rank's as the others send theirs
  // (and taking part in it even when the export fails before its gather).
  // ZeRO-3: every rank gathers the units in turn (one whole at a time); rank 0's fn gets each
  // parameter's values while its unit is whole.
  dist::ShardedParameters* const sharded = parts->sharded.get();
  auto gather_units = [&](const io::MasterValues& fn) {
    sharded->for_each_unit_values([&](const Tensor& p, const float* values) {
      if (fn) fn(p, 0, p.numel(), values);
    });
  };
  auto export_weights = [&](const std::string& file, int64_t step) {
    const bool zero_masters = zero && zero->has_masters();
    if (result.run_path.empty()) {
      if (options.write_run_dir && zero_masters && rank != 0) zero->gather_masters({});
      if (options.write_run_dir && sharded && rank != 0) gather_units({});
      return;
    }
    io::ExportOptions o = export_options(cfg, step);
    if (std::filesystem::is_regular_file(result.run_path + "/tokenizer.json"))
      o.tokenizer = "tokenizer.json";  // beside the weights (copy_run_tokenizer)
    bool units_gathered = false;
    if (sharded)
      o.sharded = [&](const io::MasterValues& fn) {
        units_gathered = true;
        gather_units(fn);
      };
    bool gathered = false;
    if (parts->offloaded && parts->offloaded->has_masters())
      o.masters = [&](const io::MasterValues& fn) { parts->offloaded->read_masters(fn); };
    if (zero_masters)
      o.masters = [&](const io::MasterValues& fn) {
        gathered = true;
        zero->gather_masters(fn);
      };
    try {
      io::export_weights(result.run_path + "/" + file, model, o);
    } catch (...) {
      if (zero_masters && !gathered && world > 1) {
        try {
          zero->gather_masters({});
        } catch (...) {
        }
      }
      if (sharded && !units_gathered && world > 1) {  // the other ranks wait in the gathers
        try {
          gather_units({});
        } catch (...) {
        }
      }
      throw;
    }
  };

  const bool resuming = !opts.resume.empty();
  data::LoaderState loader_start;
  if (resuming) {
    const Checkpoint c = read_checkpoint(resolve_checkpoint(opts.resume));
    if (c.state.data_seed != static_cast<uint64_t>(cfg.seed))
      throw std::runtime_error(fmt::format(
          "{}: saved with train.seed = {}, the config has {} (the data order would differ)", c.path,
          c.state.data_seed, cfg.seed));
    // Any checkpoint restores whatever its world size and ZeRO stage (re-sharding).
    restore_checkpoint(c, model, opt_shard());
    if (scaler.enabled() && c.state.loss_scale) scaler.load_state(*c.state.loss_scale);
    result.start_step = c.state.step;
    loader_start = c.state.loader;
    // The loader counts micro-batches of batch_size x ranks rows; the same global batch split
    // another way (more accumulation on fewer ranks: `kuai launch` after losing a host) goes on
    // from the same row, so its index is counted again in the new micro-batches.
    const TrainConfig saved = load_config_text(c.state.config_toml, c.path + "/config.toml");
    if (c.state.ranks != group->size() || saved.batch_size != cfg.batch_size) {
      const int64_t rows_then = saved.batch_size * c.state.ranks;
      const int64_t rows_now = cfg.batch_size * group->size();
      const int64_t rows = loader_start.next_index * rows_then;
      if (rows % rows_now != 0)
        throw std::runtime_error(fmt::format(
            "{}: the checkpoint's loader stopped after {} rows, which {} rows per micro-batch "
            "(train.batch_size {} x {} ranks) do not divide; keep the global batch "
            "(train.batch_size x ranks x train.accum_steps = {}) a multiple of it",
            c.path, rows, rows_now, cfg.batch_size, group->size(),
            saved.batch_size * c.state.ranks * saved.accum_steps));
      loader_start.next_index = rows / rows_now;
    }
    // Flushed: a log file shows where a run resumed even if it is killed before its next line.
    if (!opts.quiet)
      out << fmt::format("resumed from {} (step {})\n", c.path, c.state.step) << std::flush;
    // Another world size: the state loads (re-sharded); the batches go on from the row where
    // they stopped, and the sums over ranks run in another order. Said once, on rank 0.
    if (!opts.quiet && c.state.ranks != group->size() && group->rank() == 0) {
      const int64_t global = cfg.batch_size * group->size() * cfg.accum_steps;
      const int64_t was = saved.batch_size * c.state.ranks * saved.accum_steps;
      out << fmt::format(
                 "note: the checkpoint was written by {} rank{} and this run has {}: its state "
                 "was re-sharded on load. The global batch (train.batch_size x ranks x "
                 "train.accum_steps, now {}) {}; the batches go on from the row where they "
                 "stopped, and the sums over ranks run in another order, so the losses follow an "
                 "uninterrupted run's to rounding, not bit for bit\n",
                 c.state.ranks, c.state.ranks == 1 ? "" : "s", group->size(), global,
                 global == was ? std::string("is the one its run had")
                               : fmt::format("differs from its run's {}", was))
          << std::flush;
    }
  }
  if (opts.write_run_dir) result.run_path = prepare_run_dir(cfg, resuming);
  result.steps_done = result.start_step;
  // auto's kernel, decided before the first step (measured here the first time this machine sees
  // the shape), so that no step carries the measurement's time or memory.
  const bool auto_flash =
      attention == nn::AttentionImpl::kAuto &&
      nn::runs_flash(attention, nn::attention_shape(cfg.model.resolved(), B,
                                                    amp::precision_dtype(cfg.precision)));
  if (!opts.quiet) {
    out << fmt::format(
        "kuai train: {}, seq_len {}, vocab {} ({:.2f}M "
        "parameters), {} attention{}; batch {}{}, {} steps, {}, {} threads, data {} ({} loader "
        "workers)\n",
        nn::describe(cfg.model), T, V, static_cast<double>(model.num_parameters()) / 1e6,
        cfg.attention,
        attention == nn::AttentionImpl::kAuto
            ? fmt::format(" ({} at seq_len {})", auto_flash ? "flash" : "naive", T)
            : std::string(),
        B, k > 1 ? fmt::format(" x {} micro-batches", k) : std::string(), cfg.steps,
        cfg.precision == "fp32"
            ? std::string("fp32")
            : cfg.precision + " autocast" + (scaler.enabled() ? " + loss scaling" : ""),
        omp_get_max_threads(), cfg.data_source == "file" ? cfg.data_path : "synthetic",
        cfg.workers);
    if (model.recompute_layers() > 0)
      out << fmt::format("activation recomputation: {}, {} of {} blocks (docs/recompute.md)\n",
                         cfg.recompute, model.recompute_layers(), cfg.model.n_layer);
    if (ddp)
      out << fmt::format(
          "distributed: {} ranks ({}), batch {} per rank; DDP {} buckets of {:.2f} MiB of fp32 "
          "gradients in all, {} per step ({}{}), overlap {} (the traffic itself is counted: "
          "comm_mib_per_step at the end)\n",
          world, group->backend(), B, ddp->buckets().size(),
          static_cast<double>(model.num_parameters()) * 4 / (1 << 20),
          zero && zero->stage() >= 2 ? "reduce-scattered" : "all-reduced",
          cfg.compression == "none" ? "fp32" : cfg.compression + " compression",
          cfg.error_feedback && cfg.compression != "none" ? " + error feedback" : "",
          cfg.overlap ? "on" : "off");
    if (zero)
      out << fmt::format(
          "ZeRO-{}: AdamW state{} sharded, {:.1f} MiB of moments on this rank (unsharded: "
          "{:.1f}){}\n",
          zero->stage(),
          zero->stage() == 3   ? ", gradients and parameters"
          : zero->stage() == 2 ? " and gradients"
                               : "",
          static_cast<double>(zero->state_bytes()) / (1 << 20),
          static_cast<double>(zero->num_elements()) * 8 / (1 << 20),
          cfg.zero == 2 && zero->stage() == 1 ? "; one rank: stage 2 runs as stage 1" : "");
    if (sharded) {
      int64_t largest = 0;
      for (size_t u = 0; u < sharded->num_units(); ++u)
        largest = std::max(largest, sharded->unit_bytes(u));
      out << fmt::format(
          "ZeRO-3: parameters sharded in {} units (largest {:.2f} MiB whole), each gathered {} "
          "unit{} ahead{}, {} after its forward\n",
          sharded->num_units(), static_cast<double>(largest) / (1 << 20), cfg.prefetch,
          cfg.prefetch == 1 ? "" : "s",
          cfg.gather_dtype == "fp32" ? "" : " (the products' weights in " + cfg.gather_dtype + ")",
          cfg.reshard_after_forward ? "released" : "kept for backward");
    }
    if (cfg.offload == "disk") {
      const optim::OffloadedMoments& om = zero ? *zero->offloaded() : parts->offloaded->moments();
      out << fmt::format(
          "optimizer state offloaded to disk: {:.1f} MiB of moments{} in {} ({}, {}), streamed "
          "through {:.1f} MiB of chunk buffers\n",
          static_cast<double>(om.file_bytes()) / (1 << 20),
          om.has_masters()
              ? fmt::format(
                    " and the fp32 master weights of {:.2f}M parameters (the products', "
                    "kept in {} in memory)",
                    [&] {
                      int64_t n = 0;
                      for (const Tensor& p : nn::product_parameters(model)) n += p.numel();
                      return static_cast<double>(n) / 1e6;
                    }(),
                    cfg.precision)
              : std::string(),
          om.dir(), om.stream().direct() ? "O_DIRECT" : "page cache: O_DIRECT refused", "io_uring",
          static_cast<double>(om.buffer_bytes()) / (1 << 20));
    }
    if (!result.run_path.empty()) out << "run directory: " << result.run_path << "\n";
    out.flush();
  }

  data::LoaderOptions lopt;
  lopt.workers = static_cast<int>(cfg.workers);
  lopt.prefetch_factor = static_cast<int>(cfg.prefetch_factor);
  lopt.delay_ms = cfg.delay_ms;
  data::DataLoader loader(sources.train, lopt, loader_start.next_index);
  log::MetricRing ring(make_sinks(cfg, opts, out, result.run_path, resuming), cfg.log_every);
  // Full checkpoints every save_every steps, and on a stop request.
  // With ZeRO on several ranks each rank writes its own optimizer shard, and with ZeRO-3 its model
  // shard (every rank has a Checkpointer on the same shared run directory); otherwise rank 0
  // writes everything.
  std::unique_ptr<Checkpointer> ckpt;
  std::optional<OptimizerShard> shard;
  const bool sharded_ckpt = zero && world > 1;
  if (options.write_run_dir && (cfg.save_every > 0 || options.stop) &&
      (sharded_ckpt || !result.run_path.empty())) {
    const std::string dir =
        (std::filesystem::path(cfg.run_dir) / cfg.run_name).string();  // result.run_path on rank 0
    ckpt = std::make_unique<Checkpointer>(dir, cfg.keep_last, cfg.async_save,
                                          sharded_ckpt ? group : nullptr);
    shard = opt_shard();
  }
  const std::string config_text = to_toml(cfg);
  // Saves at `step` (completed steps). Returns false when training must stop (on_error = stop).
  int64_t last_saved = -1;
  // A failed save (or commit): reported; returns false when training must stop (on_error = stop).
  auto save_failed = [&](const std::exception& e) {
    ++result.save_failures;
    result.save_error = e.what();
    out << fmt::format("\ncheckpoint failed: {}{}\n", e.what(),
                       cfg.on_save_error == "stop" ? "; stopping (checkpoint.on_error = stop)"
                                                   : "; training continues");
    out.flush();
    return cfg.on_save_error != "stop";
  };
  auto save_checkpoint = [&](int64_t step) {
    if (step == last_saved) return true;
    try {
      const double blocked =
          ckpt->save(model, *shard,
                     {step, loader.state(), uint64_t(cfg.seed), config_text,
                      scaler.enabled() ? std::optional(scaler.state()) : std::nullopt, world});
      result.save_blocked_ms.push_back(blocked);
      ++result.checkpoints_saved;
      last_saved = step;
      return true;
    } catch (const std::exception& e) {
      return save_failed(e);
    }
  };
  // The sharded save's second half, one step later (see Checkpointer::commit).
  auto commit_checkpoint = [&]() {
    try {
      ckpt->commit();
      return true;
    } catch (const std::exception& e) {
      --result.checkpoints_saved;  // counted when its files were handed to the writer
      return save_failed(e);
    }
  };

  Allocator::get().reset_peak();
  int64_t first_step_peak = 0, faults_after_first = 0;
  const double tokens_per_step = static_cast<double>(B * T * k * world);  // over all ranks
  using ms = std::chrono::duration<double, std::milli>;
  bool stop_agreed = false;
  Tensor stop_flag;  // several ranks: the stop request, in host memory
  std::shared_ptr<dist::Work> stop_work;
  // The measured counters of the steps (TrainResult::host_reads_per_step, ...).
  using Collective = dist::ProcessGroup::Collective;
  int64_t steps_counted = 0, reads_in_steps = 0, sent_in_steps = 0;
  double gather_wait_s = 0;  // ZeRO-3: over the counted steps
  int64_t reduced_in_steps = 0, reduced_in_backward = 0;
  // The communication thread's time on all-reduces and reduce-scatters over the run (read at its
  // end, when every collective has completed).
  const double reduce_seconds0 = group->stats(Collective::kAllReduce).seconds +
                                 group->stats(Collective::kReduceScatter).seconds;
  const double reduce_seconds_in_backward0 =
      group->stats(Collective::kAllReduce).seconds_in_backward +
      group->stats(Collective::kReduceScatter).seconds_in_backward;
  std::shared_ptr<dist::Work> loss_work;
  // Several ranks: the logged loss is the mean over ranks, averaged by an all-reduce queued
  // behind the gradient buckets that the logger thread waits for before it reads the loss; and
  // every rank learns whether any was asked to stop through a flag in host memory (never a
  // device value), all-reduced now and read at the start of the next step, when it has long
  // completed. Neither blocks the step nor reads a device value. Run after the step (eager or
  // compiled): the step's own collectives are the gradient buckets.
  auto reduce_loss_and_stop = [&](Tensor& loss) {
    if (world <= 1) return;
    autograd::NoGradGuard no_grad;
    loss = contiguous(reshape(loss, {1}));
    loss_work = group->all_reduce(loss, dist::ReduceOp::kAvg);
    loss = reshape(loss, {});
    stop_flag = full({1}, opts.stop && opts.stop->load() ? 1.0f : 0.0f, DType::kF32, kCPU);
    stop_work = group->all_reduce(stop_flag, dist::ReduceOp::kSum);
  };
  // The step itself (train_step.h): micro-batches, DDP, the scaler, clipping, the update, and
  // under train.compile its capture and replays (technique 4).
  TrainStep& train_step = *parts->step;
  const CompiledStep* compiled = train_step.compiled();
  for (int64_t step = result.start_step; step < cfg.steps; ++step) {
    // ZeRO on several ranks: the checkpoint saved after the previous step is put in place now
    // (a collective; its files were written meanwhile).
    if (ckpt && sharded_ckpt && !commit_checkpoint()) {
      result.interrupted = true;
      break;
    }
    // With several ranks, the stop request agreed on in the previous step (every rank stops at
    // the same step); alone, this process's own.
    if (stop_work) {
      stop_work->wait();  // queued a step ago: complete
      stop_work.reset();
      // The flag is reduced by the process group in host memory: not a device read.
      stop_agreed = stop_flag.data<float>()[0] > 0.0f;
    }
    if (world > 1 ? stop_agreed : opts.stop && opts.stop->load()) {
      result.interrupted = true;
      if (ckpt && step > result.start_step) save_checkpoint(step);
      break;
    }
    const auto t0 = std::chrono::steady_clock::now();
    // From here to the counters below the thread runs a step: host access to tensor bytes counts.
    std::optional<StepScope> in_step(std::in_place);
    const int64_t reads0 = host_reads_this_thread();
    const dist::ProcessGroup::CollectiveStats all0 = group->total_stats(),
                                              ar0 = group->stats(Collective::kAllReduce),
                                              rs0 = group->stats(Collective::kReduceScatter);
    const double gather_wait0 = sharded ? sharded->stats().wait_seconds : 0.0;
    const double lr = learning_rate(cfg, step);
    opt.set_lr(static_cast<float>(lr));
    double wait_ms = 0.0, data_ms = 0.0;
    loss_work.reset();
    if (step > result.start_step)
      result.step_start_bytes = std::max(result.step_start_bytes, Allocator::get().stats().current);
    StepOutputs st = train_step.step([&](int64_t) {
      const auto td = std::chrono::steady_clock::now();
      data::Batch batch = loader.next();
      wait_ms += loader.last_wait_ms();
      data_ms += ms(std::chrono::steady_clock::now() - td).count();
      return batch;
    });
    const std::chrono::steady_clock::time_point t_fb = st.backward_done;
    reduce_loss_and_stop(st.loss);
    Tensor loss = st.loss;  // (loss_work: set on several ranks)
    const Tensor& norm = st.grad_norm;
    const Tensor& scale_used = st.loss_scale;
    if (cfg.sync_every_step) {  // the habit technique 10 removes
      if (loss_work) loss_work->wait();
      (void)loss.item();
    }
    const double step_ms = ms(std::chrono::steady_clock::now() - t0).count();
    if (compiled && compiled->executable()) {
      result.compile_arena_bytes = compiled->executable()->arena_bytes();
      result.compile_nodes = static_cast<int64_t>(compiled->executable()->graph().nodes.size());
    }
    {
      const auto ar = group->stats(Collective::kAllReduce);
      const auto rs = group->stats(Collective::kReduceScatter);
      ++steps_counted;
      if (sharded) gather_wait_s += sharded->stats().wait_seconds - gather_wait0;
      reads_in_steps += host_reads_this_thread() - reads0;
      sent_in_steps += group->total_stats().bytes_sent - all0.bytes_sent;
      reduced_in_steps += ar.bytes_sent - ar0.bytes_sent + rs.bytes_sent - rs0.bytes_sent;
      reduced_in_backward += ar.bytes_sent_in_backward - ar0.bytes_sent_in_backward +
                             rs.bytes_sent_in_backward - rs0.bytes_sent_in_backward;
    }
    in_step.reset();
    if (profiler::enabled()) {
      profiler::record("[step] data", data_ms);
      profiler::record("[step] forward+backward", ms(t_fb - t0).count() - data_ms);
      profiler::record("[step] optimizer", ms(std::chrono::steady_clock::now() - t_fb).count());
      if (step == result.start_step) profiler::reset();  // profile the steady state
    }
    result.step_ms.push_back(step_ms);
    if (step == result.start_step) {
      // The steady state is measured from the second step: the first one captures under
      // train.compile (an eager step), and the first step of any run allocates its caches.
      first_step_peak = Allocator::get().stats().peak;
      Allocator::get().reset_peak();
      faults_after_first = minor_faults();
    }
    const double rss = current_rss_mib();
    result.rss_max_mib = std::max(result.rss_max_mib, rss);
    if (step > result.start_step)
      result.rss_steady_max_mib = std::max(result.rss_steady_max_mib, rss);
    result.data_wait_ms.push_back(wait_ms);

    log::StepMetrics m;
    m.step = step + 1;
    m.device = {{"loss", loss}, {"grad_norm", norm}};
    if (loss_work) m.ready = [loss_work] { loss_work->wait(); };
    m.host = {{"lr", lr},
              {"step_ms", step_ms},
              {"data_wait_ms", wait_ms},
              {"tokens_per_s", tokens_per_step / (step_ms / 1000.0)}};
    if (scale_used.defined()) m.device.emplace_back("loss_scale", scale_used);
    if (st.skipped.defined()) m.device.emplace_back("skipped", st.skipped);
    const bool last = step + 1 == cfg.steps;
    if (sources.val && cfg.eval_every > 0 && ((step + 1) % cfg.eval_every == 0 || last)) {
      train_step.release_memory();  // a compiled step's arena is not held through evaluation
      m.device.emplace_back(
          "val_loss",
          mean_over_ranks(*group, evaluate(model, *sources.val, cfg.eval_batches, compute)));
    }
    result.steps_done = step + 1;
    if (step == result.start_step && group->rank() == 0) report_first_step(step + 1);
    if (ckpt && cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) {
      const bool go_on = save_checkpoint(step + 1);
      if (!result.save_blocked_ms.empty() && go_on)
        m.host.emplace_back("checkpoint_blocked_ms", result.save_blocked_ms.back());
      if (!go_on) {
        m.wall_time = now_s();
        ring.push(std::move(m));
        result.interrupted = true;
        break;
      }
    }
    if (options.write_run_dir && cfg.export_every > 0 && (step + 1) % cfg.export_every == 0)
      export_weights(fmt::format("weights-{}.safetensors", step + 1), step + 1);
    m.wall_time = now_s();
    ring.push(std::move(m));
    if (opts.after_step) opts.after_step(step + 1);
  }
  if (stop_work) stop_work->wait();  // the last step's flag: every queued collective completes
  if (compiled) {
    result.compile_captures = compiled->captures();
    result.compile_eager = compiled->eager();
  }
  const int64_t sent = group->total_stats().bytes_sent;
  result.comm_bytes_sent_by_rank = {sent};
  if (world > 1) {  // each rank's count as two 31-bit halves (exact in int32)
    const Tensor mine = from_vector(std::vector<int32_t>{static_cast<int32_t>(sent >> 31),
                                                         static_cast<int32_t>(sent & 0x7fffffff)},
                                    {2});
    const Tensor all = zeros({2 * world}, DType::kI32);
    group->all_gather(mine, all)->wait();
    const std::vector<int32_t> halves = all.to_vector<int32_t>();
    result.comm_bytes_sent_by_rank.clear();
    for (int r = 0; r < world; ++r)
      result.comm_bytes_sent_by_rank.push_back((int64_t{halves[2 * r]} << 31) | halves[2 * r + 1]);
  }
  if (steps_counted > 0) {
    const double n = static_cast<double>(steps_counted);
    result.host_reads_per_step = static_cast<double>(reads_in_steps) / n;
    result.comm_mib_per_step = static_cast<double>(sent_in_steps) / n / (1 << 20);
    result.overlap = reduced_in_steps > 0 ? static_cast<double>(reduced_in_backward) /
                                                static_cast<double>(reduced_in_steps)
                                          : 0.0;
    const auto ar = group->stats(Collective::kAllReduce);
    const auto rs = group->stats(Collective::kReduceScatter);
    const double secs = ar.seconds + rs.seconds - reduce_seconds0;
    const double secs_bw =
        ar.seconds_in_backward + rs.seconds_in_backward - reduce_seconds_in_backward0;
    result.overlap_time = secs > 0 ? secs_bw / secs : 0.0;
    result.comm_ms_per_step = secs / n * 1e3;
    result.gather_wait_ms_per_step = gather_wait_s / n * 1e3;
  }
  if (ckpt) {
    try {
      ckpt->wait();  // the save in flight completes before the run ends
    } catch (const std::exception& e) {
      ++result.save_failures;
      result.save_error = e.what();
      out << fmt::format("\ncheckpoint failed: {}\n", e.what());
    }
  }
  ring.flush();
  result.peak_alloc_steady_bytes = steps_counted > 1 ? Allocator::get().stats().peak : 0;
  result.alloc_reserved_bytes = Allocator::get().stats().reserved;
  result.peak_alloc_bytes = std::max(first_step_peak, Allocator::get().stats().peak);
  if (steps_counted > 1)
    result.minor_faults_per_step = static_cast<double>(minor_faults() - faults_after_first) /
                                   static_cast<double>(steps_counted - 1);

  for (const log::LoggedStep& s : ring.history()) {
    result.losses.push_back(static_cast<float>(s.get("loss")));
    result.grad_norms.push_back(static_cast<float>(s.get("grad_norm")));
    if (s.has("val_loss")) result.val_losses.emplace_back(s.step, float(s.get("val_loss")));
    if (s.has("skipped") && s.get("skipped") != 0.0) ++result.skipped_steps;
  }
  std::vector<double> timed(result.step_ms.begin() + (result.step_ms.size() > 1 ? 1 : 0),
                            result.step_ms.end());
  result.step_ms_median = median(timed);
  if (result.step_ms_median > 0)
    result.tokens_per_s = tokens_per_step / (result.step_ms_median / 1e3);
  std::vector<double> waits(result.data_wait_ms.begin() + (result.data_wait_ms.size() > 1 ? 1 : 0),
                            result.data_wait_ms.end());
  result.data_wait_ms_median = median(waits);
  result.final_loss = result.losses.empty() ? 0.0f : result.losses.back();
  result.peak_rss_mib = peak_rss_mib();

  if (options.write_run_dir && cfg.save_weights)
    export_weights("model.safetensors", result.steps_done);
  if (!opts.quiet) {
    if (result.interrupted)
      out << fmt::format("interrupted: stopped cleanly after step {}\n", result.steps_done);
    if (ckpt && result.checkpoints_saved > 0)
      out << fmt::format("checkpoint: {} (latest of {} saved; median blocked {:.1f} ms/save)\n",
                         ckpt->last_stats().path, result.checkpoints_saved,
                         median(result.save_blocked_ms));
    const MemoryStats mem = Allocator::get().stats();
    out << fmt::format(
        "memory: peak live tensors {:.1f} MiB, allocator reserved {:.1f} MiB, peak RSS {:.1f} "
        "MiB; data wait median {:.2f} ms/step\n",
        static_cast<double>(mem.peak) / (1 << 20), static_cast<double>(mem.reserved) / (1 << 20),
        result.peak_rss_mib, result.data_wait_ms_median);
    if (compiled)
      out << fmt::format(
          "compile: {} capture{}, {} replays{}; graph of {} nodes, arena {:.2f} MiB ({})\n",
          compiled->captures(), compiled->captures() == 1 ? "" : "s", compiled->replays(),
          compiled->eager() ? " (then eager)" : "", result.compile_nodes,
          static_cast<double>(result.compile_arena_bytes) / (1 << 20), cfg.compile_memory);
    if (!result.run_path.empty() && cfg.save_weights)
      out << "weights: " << result.run_path << "/model.safetensors\n";
    if (profiler::enabled())
      out << "profile (KUAI_PROFILE=1), steps 2..N:\n"
          << profiler::report(plan::measure_bandwidth().dram());
  }
  return result;
}

}  // namespace kuai::train
