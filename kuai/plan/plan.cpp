// `kuai plan` (see plan.h).
#include "kuai/plan/plan.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

#include "kuai/amp/autocast.h"
#include "kuai/plan/cache_file.h"

namespace kuai::plan {

namespace {

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::string human_bytes(double b) {
  if (b >= double(int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / double(int64_t{1} << 30));
  if (b >= double(1 << 20)) return fmt::format("{:.1f} MiB", b / double(1 << 20));
  return fmt::format("{:.1f} KiB", b / 1024.0);
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// "12.5GiB" -> (12.5, "gib")
std::pair<double, std::string> number_and_unit(const std::string& text, const std::string& what) {
  const std::string t = trim(text);
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(t, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument(fmt::format("{} = '{}' is not a number with a unit", what, text));
  }
  std::string unit = trim(t.substr(used));
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (!(v >= 0) || !std::isfinite(v))
    throw std::invalid_argument(fmt::format("{} = '{}' must be a non-negative number", what, text));
  return {v, unit};
}

}  // namespace

int64_t parse_bytes(const std::string& text, const std::string& what) {
  const auto [v, unit] = number_and_unit(text, what);
  const std::pair<const char*, double> units[] = {{"", 1},
                                                  {"b", 1},
                                                  {"kib", 1024.0},
                                                  {"kb", 1e3},
                                                  {"mib", 1 << 20},
                                                  {"mb", 1e6},
                                                  {"gib", 1073741824.0},
                                                  {"gb", 1e9},
                                                  {"tib", 1099511627776.0},
                                                  {"tb", 1e12},
                                                  {"k", 1024.0},
                                                  {"m", 1 << 20},
                                                  {"g", 1073741824.0}};
  for (const auto& [name, f] : units)
    if (unit == name) return static_cast<int64_t>(v * f);
  throw std::invalid_argument(fmt::format(
      "{} = '{}': unknown unit '{}' (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", what, text, unit));
}

double parse_gbs(const std::string& text, const std::string& what) {
  const auto [v, unit] = number_and_unit(text, what);
  if (unit == "gb/s" || unit == "gbs" || unit == "") return v;
  if (unit == "mb/s") return v / 1e3;
  if (unit == "gbit/s" || unit == "gbps") return v / 8;
  throw std::invalid_argument(
      fmt::format("{} = '{}': unknown unit '{}' (GB/s, MB/s, Gbit/s)", what, text, unit));
}

double parse_us(const std::string& text, const std::string& what) {
  const auto [v, unit] = number_and_unit(text, what);
  if (unit == "us" || unit == "") return v;
  if (unit == "ms") return v * 1e3;
  if (unit == "ns") return v / 1e3;
  throw std::invalid_argument(
      fmt::format("{} = '{}': unknown unit '{}' (us, ms, ns)", what, text, unit));
}

int64_t machine_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemTotal:") return kb * 1024;
  return int64_t{16} << 30;
}

StepSpec step_spec(const train::TrainConfig& cfg, int64_t ranks, int threads) {
  StepSpec s;
  s.model = cfg.model.resolved();
  s.batch = cfg.batch_size;
  s.seq = cfg.model.seq_len;
  s.accum = cfg.accum_steps;
  s.compute = amp::precision_dtype(cfg.precision);
  s.flash = nn::runs_flash(nn::parse_attention_impl(cfg.attention),
                           nn::attention_shape(s.model, s.batch, s.compute));
  s.ranks = ranks;
  s.zero = ranks > 1 ? cfg.zero : 0;
  s.compression = ranks > 1 ? cfg.compression : "none";
  s.threads = threads;
  s.recompute = cfg.recompute;
  s.recompute_layers = cfg.recompute == "none"    ? 0
                       : cfg.recompute_layers < 0 ? s.model.n_layer
                                                  : std::min(cfg.recompute_layers, s.model.n_layer);
  s.offload = cfg.offload;
  s.offload_master = cfg.offload_master;
  return s;
}

// ---- the link --------------------------------------------------------------------------------

double Link::seconds(const std::string& op, double bytes, int64_t ranks) const {
  if (ranks <= 1) return 0.0;
  const double n = static_cast<double>(ranks);
  const double steps = op == "all_reduce" ? 2.0 * (n - 1) : (n - 1);
  return steps / n * bytes / (bandwidth_gbs * 1e9) + steps * latency_us * 1e-6;
}

std::string link_file() { return cache_file("link.json"); }

std::optional<Link> measured_link() {
  std::ifstream in(link_file());
  if (!in) return std::nullopt;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    Link l;
    l.bandwidth_gbs = j.at("bandwidth_gbs").get<double>();
    l.latency_us = j.at("latency_us").get<double>();
    l.source = fmt::format("measured by kuai bench ddp ({})", link_file());
    if (!(l.bandwidth_gbs > 0) || !(l.latency_us >= 0)) return std::nullopt;
    return l;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

Link measured_or_assumed_link() {
  if (const auto m = measured_link()) return *m;
  Link l;
  l.bandwidth_gbs = 10.0;
  l.latency_us = 20.0;
  l.source = "assumed: run `kuai bench ddp` to measure it";
  return l;
}

void save_link(const Link& link) {
  save_file_atomically(
      link_file(),
      nlohmann::json{{"bandwidth_gbs", link.bandwidth_gbs}, {"latency_us", link.latency_us}}.dump(
          2) +
          "\n");
}

// ---- time ------------------------------------------------------------------------------------

TimePrediction predict_time(const StepSpec& spec, const StepTrace& step, const MachineCosts& costs,
                            const Link& link) {
  TimePrediction t;
  double now = 0, comm_free = 0, pending = 0;  // pending: end of the collectives not waited for
  bool backward = false;
  size_t next = 0;
  // Gathers waited for where their first reader runs (ZeRO-3's prefetch overlaps them with the
  // units before): (that op's index, when the gather ends).
  std::vector<std::pair<size_t, double>> waits;
  auto launch = [&](const CollectiveEvent& e) {
    const dist::CollectiveRecord& c = e.collective;
    double d = link.seconds(c.op, double(c.bytes), spec.ranks);
    // Compression: the bucket cast into the wire dtype and back (12 bytes per element moved).
    if (c.op == "all_reduce" && c.dtype != DType::kF32 && costs.bandwidth.dram() > 0)
      d += double(c.bytes) * 6 / (costs.bandwidth.dram() * 1e9);
    const double start = std::max(comm_free, now);
    comm_free = start + d;
    t.comm_s += d;
    if (c.bytes <= 64) return;  // a scalar: never waited for within the step
    if (e.needed_at != CollectiveEvent::kNever) {
      waits.emplace_back(e.needed_at, comm_free);
      return;
    }
    if (c.in_backward)
      pending = std::max(pending, comm_free);
    else
      now = std::max(now, comm_free);  // waited for at once
  };
  for (size_t i = 0; i < step.ops.size(); ++i) {
    const OpRecord& op = step.ops[i];
    while (next < step.collectives.size() && step.collectives[next].at <= i)
      launch(step.collectives[next++]);
    for (auto w = waits.begin(); w != waits.end();)
      if (w->first <= i) {
        now = std::max(now, w->second);
        w = waits.erase(w);
      } else {
        ++w;
      }
    if (backward && !op.backward) now = std::max(now, pending);  // backward over: wait
    backward = op.backward;
    const double k = op_seconds(op, costs);
    if (op.cost.disk_read + op.cost.disk_written > 0)
      t.disk_s += k;
    else if (op.primitive->op_class() == OpClass::kAttention)
      t.attention_s += k;
    else if (op.cost.flops > 0)
      t.products_s += k;
    else
      t.memory_s += k;
    t.flops += op.cost.flops;
    t.overhead_s += costs.op_overhead_s;
    now += k + costs.op_overhead_s;
  }
  while (next < step.collectives.size()) launch(step.collectives[next++]);
  now = std::max(now, pending);
  for (const auto& w : waits) now = std::max(now, w.second);
  t.step_s = now;
  t.comm_exposed_s =
      std::max(0.0, now - (t.products_s + t.attention_s + t.memory_s + t.disk_s + t.overhead_s));
  t.tokens_per_s = double(step.tokens * spec.ranks) / t.step_s;
  return t;
}

namespace {

// The trace without the products' scratch (it lists the ops to measure), the ops measured, then
// the trace with it. `first`: the first trace, when the caller made it already.
StepTrace trace_with_costs(TraceTarget target, MachineCosts& costs,
                           const StepTrace* first = nullptr) {
  measure_costs(first != nullptr ? *first : trace_step(target), costs);
  target.extra_scratch = [&costs](const OpRecord& op) {
    const auto it = costs.ops.find(op.key);
    return it == costs.ops.end() ? int64_t{0}
                                 : std::max<int64_t>(0, it->second.scratch - op.formula_scratch);
  };
  return trace_step(target);
}

}  // namespace

Prediction predict_target(const TraceTarget& target, const StepSpec& spec, int64_t budget_bytes,
                          const Link& link, MachineCosts& costs) {
  Prediction p;
  p.spec = spec;
  p.step = trace_with_costs(target, costs);
  p.time = predict_time(p.spec, p.step, costs, link);
  p.budget_bytes = budget_bytes;
  return p;
}

Prediction predict(const train::TrainConfig& cfg, int64_t ranks, int64_t budget_bytes,
                   const Link& link, MachineCosts& costs) {
  return predict_target(target_for(cfg, ranks), step_spec(cfg, ranks, omp_get_max_threads()),
                        budget_bytes, link, costs);
}

std::vector<ScalingRow> scaling(const train::TrainConfig& cfg, const Link& link,
                                MachineCosts& costs, const std::vector<int64_t>& ranks) {
  std::vector<ScalingRow> rows;
  double one = 0;
  for (int64_t n : ranks) {
    const Prediction p = predict(cfg, n, 0, link, costs);
    ScalingRow r;
    r.ranks = n;
    r.tokens_per_s = p.time.tokens_per_s;
    r.step_ms = p.time.step_s * 1e3;
    r.comm_exposed_ms = p.time.comm_exposed_s * 1e3;
    r.peak_bytes = p.step.peak_bytes;
    if (n == 1) one = r.tokens_per_s;
    r.efficiency = one > 0 ? r.tokens_per_s / (double(n) * one) : 0.0;
    rows.push_back(r);
  }
  return rows;
}

// ---- fit -------------------------------------------------------------------------------------

std::string FitOption::command(const std::string& config_path,
                               const std::vector<std::string>& given) const {
  std::string s = ranks > 1 ? fmt::format("mpirun -np {} kuai train", ranks) : "kuai train";
  if (!config_path.empty()) s += " --config " + config_path;
  // The overrides the plan was given, except those a change replaces (the last one wins anyway).
  auto key_of = [](std::string o) {
    if (o.rfind("--", 0) == 0) o = o.substr(2);
    return o.substr(0, o.find('='));
  };
  for (const std::string& g : given) {
    bool replaced = false;
    for (const std::string& o : overrides) replaced = replaced || key_of(o) == key_of(g);
    if (!replaced) s += " " + g;
  }
  for (const std::string& o : overrides) s += " " + o;
  return s;
}

namespace {
// The recomputation policies --fit tries, cheapest first from the config's own.
std::vector<std::string> recompute_ladder(const std::string& own) {
  if (own == "full") return {"full"};
  if (own == "selective") return {"selective", "full"};
  return {"none", "selective", "full"};
}
}  // namespace

std::vector<FitOption> fit(const train::TrainConfig& cfg, int64_t ranks, int64_t budget_bytes,
                           const Link& link, MachineCosts& costs, double headroom) {
  const int64_t B = cfg.batch_size, k = cfg.accum_steps;
  std::vector<int64_t> rank_options = {ranks};
  for (int64_t f : {2, 4, 8, 16, 32, 64})
    if ((B * ranks) % (ranks * f) == 0) rank_options.push_back(ranks * f);
  // Flash only where the config does not run it already ("auto": where this machine measured it
  // faster).
  const bool flash_already = nn::runs_flash(
      nn::parse_attention_impl(cfg.attention),
      nn::attention_shape(cfg.model.resolved(), B, amp::precision_dtype(cfg.precision)));
  std::vector<FitOption> out;
  std::set<std::string> seen;
  for (int64_t n : rank_options) {
    const int64_t rows_per_rank = B * ranks / n;  // the same global batch
    for (int64_t rows = rows_per_rank; rows >= 1; rows /= 2) {
      if (rows_per_rank % rows != 0) continue;
      const int64_t accum = k * (rows_per_rank / rows);
      for (const std::string& precision :
           std::vector<std::string>{cfg.precision, cfg.precision == "fp32" ? "bf16" : ""}) {
        if (precision.empty()) continue;
        for (const std::string& attention :
             std::vector<std::string>{cfg.attention, flash_already ? "" : "flash"}) {
          if (attention.empty()) continue;
          for (int64_t zero : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}}) {
            if (n == 1 && zero > 0) continue;
            // ZeRO-3 gathers the products' weights in the compute dtype (half the bytes on the
            // wire and whole; the losses are those of DDP in that dtype).
            const std::string gather = zero == 3 && precision != "fp32" ? precision : "fp32";
            // Offload costs disk time, recomputation compute time: for each of the config's own
            // placement of the optimizer state, disk, and disk with the master weights (mixed
            // precision), the config's own policy first, then selective, then full, each only
            // where the cheaper ones did not fit.
            const std::string own = cfg.offload_master ? "master" : cfg.offload;
            const bool masters_possible = precision != "fp32";
            for (const std::string& offload : std::vector<std::string>{
                     masters_possible || own != "master" ? own : "", own == "none" ? "disk" : "",
                     own != "master" && masters_possible ? "master" : ""}) {
              if (offload.empty()) continue;
              if (zero == 3 && offload == "master") continue;  // its masters are the shard
              for (const std::string& recompute : recompute_ladder(cfg.recompute)) {
                train::TrainConfig c = cfg;
                c.batch_size = rows;
                c.accum_steps = accum;
                c.precision = precision;
                c.attention = attention;
                c.zero = zero;
                c.recompute = recompute;
                c.offload = offload == "master" ? "disk" : offload;
                c.offload_master = offload == "master";
                c.gather_dtype = zero == 3 ? gather : "fp32";
                std::vector<std::string> o;
                if (rows != B) o.push_back(fmt::format("--train.batch_size={}", rows));
                if (accum != k) o.push_back(fmt::format("--train.accum_steps={}", accum));
                if (precision != cfg.precision) o.push_back("--train.precision=" + precision);
                if (attention != cfg.attention) o.push_back("--model.attention=" + attention);
                if (zero != cfg.zero && n > 1) o.push_back(fmt::format("--dist.zero={}", zero));
                if (c.gather_dtype != cfg.gather_dtype && n > 1)
                  o.push_back("--dist.gather_dtype=" + c.gather_dtype);
                if (recompute != cfg.recompute) o.push_back("--train.recompute=" + recompute);
                if (c.offload != cfg.offload) o.push_back("--train.offload=" + c.offload);
                if (c.offload_master != cfg.offload_master)
                  o.push_back(fmt::format("--train.offload_master={}", c.offload_master));
                std::string key = fmt::format("{}", n);
                for (const auto& x : o) key += " " + x;
                if (!seen.insert(key).second) continue;
                const TraceTarget target = target_for(c, n);
                const StepTrace quick = trace_step(target);  // without the products' scratch
                if (double(quick.peak_bytes) > double(budget_bytes) * (1.0 - headroom)) continue;
                Prediction p;
                p.spec = step_spec(c, n, omp_get_max_threads());
                p.step = trace_with_costs(target, costs, &quick);
                p.time = predict_time(p.spec, p.step, costs, link);
                p.budget_bytes = budget_bytes;
                if (double(p.step.peak_bytes) > double(budget_bytes) * (1.0 - headroom)) continue;
                FitOption f;
                f.overrides = o;
                f.ranks = n;
                f.peak_bytes = p.step.peak_bytes;
                f.step_s = p.time.step_s;
                f.tokens_per_s = p.time.tokens_per_s;
                out.push_back(f);
                break;  // fits: a costlier policy is not needed
              }
            }
          }
        }
      }
    }
  }
  // The ranks the run has first (no more hardware), then each larger count; fastest first.
  std::sort(out.begin(), out.end(), [](const FitOption& a, const FitOption& b) {
    if (a.ranks != b.ranks) return a.ranks < b.ranks;
    if (a.step_s != b.step_s) return a.step_s < b.step_s;
    return a.overrides.size() < b.overrides.size();
  });
  return out;
}

// ---- report ----------------------------------------------------------------------------------

std::string report(const Prediction& p, const MachineCosts& costs, const Link& link,
                   const std::vector<ScalingRow>& scale, int64_t save_every, bool compile) {
  const StepSpec& s = p.spec;
  const StepTrace& m = p.step;
  std::ostringstream o;
  o << fmt::format("plan: {}; batch {} x {} tokens per rank, {} micro-batch{}, {}, {} attention",
                   nn::describe(s.model), s.batch, s.seq, s.accum, s.accum == 1 ? "" : "es",
                   s.compute == DType::kF32 ? std::string("fp32") : dtype_name(s.compute),
                   s.flash ? "flash" : "naive");
  if (s.recompute_layers > 0)
    o << fmt::format("; {} recomputation of {} block{}", s.recompute, s.recompute_layers,
                     s.recompute_layers == 1 ? "" : "s");
  if (s.offload == "disk")
    o << (s.offload_master ? "; optimizer state and master weights offloaded to disk"
                           : "; optimizer state offloaded to disk");
  if (s.ranks > 1)
    o << fmt::format("; {} ranks, ZeRO {}, compression {}", s.ranks, s.zero, s.compression);
  o << "\n" << fmt::format("machine: {}\n", costs.cpu);
  o << fmt::format("(the step run on meta tensors: {} ops, {} collectives traced)\n\n",
                   m.ops.size(), m.collectives.size());

  o << fmt::format("memory per rank at the step's peak ({}):\n", m.peak_where);
  for (size_t u = 0; u < m.at_peak.size(); ++u) {
    const MemoryUse use = static_cast<MemoryUse>(u);
    if (m.at_peak[u] == 0 && m.persistent[u] == 0) continue;
    const std::string name =
        s.offload_master && use == MemoryUse::kParameters
            ? fmt::format("parameters (products' in {})", dtype_name(s.compute))
            : std::string(memory_use_name(use));
    o << fmt::format("  {:<36} {:>12}   (held across steps {})\n", name,
                     human_bytes(double(m.at_peak[u])), human_bytes(double(m.persistent[u])));
  }
  if (s.offload == "disk")
    o << "  (train.offload = disk: the optimizer row is the chunk buffers the moments stream "
         "through; the moments themselves are in files)\n";
  if (s.offload_master)
    o << fmt::format(
        "  {:<36} {:>12}   (the products' fp32 masters are in the offload files; "
        "their parameters are held in {})\n",
        "master weights", "0 B", dtype_name(s.compute));
  else
    o << fmt::format("  {:<36} {:>12}   (the fp32 parameters are the masters{})\n",
                     "master weights", "0 B extra",
                     s.compute == DType::kF32 ? "; fp32 training" : "");
  o << fmt::format("  {:<36} {:>12}   of {} per rank: {}\n", "peak of live tensors",
                   human_bytes(double(m.peak_bytes)), human_bytes(double(p.budget_bytes)),
                   p.fits() ? "fits"
                            : fmt::format("does not fit ({:.2f}x)",
                                          double(m.peak_bytes) / double(p.budget_bytes)));
  o << fmt::format("  largest kernel scratch {}\n", human_bytes(double(m.workspace_max)));
  if (save_every > 0 && s.offload_master)
    o << "  (checkpoint.save_every: the model file streams from the masters' file and the "
         "parameters kept in fp32, the moments from theirs: no host snapshot)\n";
  else if (save_every > 0 && s.offload == "disk")
    o << fmt::format(
        "  (checkpoint.save_every: each save also holds a host snapshot of the parameters, {}, "
        "outside the tracking allocator: it shows in RSS, not in this peak; the offloaded "
        "moments stream from their files into the checkpoint)\n",
        human_bytes(double(m.persistent[static_cast<size_t>(MemoryUse::kParameters)])));
  else if (save_every > 0)
    o << fmt::format(
        "  (checkpoint.save_every: each save also holds a host snapshot of the parameters and "
        "moments, {}, outside the tracking allocator: it shows in RSS, not in this peak)\n",
        human_bytes(double(m.persistent[static_cast<size_t>(MemoryUse::kParameters)] +
                           m.persistent[static_cast<size_t>(MemoryUse::kOptimizer)])));
  if (compile)
    o << "  (train.compile: the step captured on meta and replayed in its planned arena; the "
         "time below is the eager step's, before the graph's fusions)\n";
  o << "\n";

  o << fmt::format("tensors saved for backward (last micro-batch, end of forward): {}\n",
                   human_bytes(double(m.saved_total)));
  size_t shown = 0;
  for (const SavedRow& r : m.saved) {
    if (shown++ == 14) {
      o << fmt::format("  ... {} more kinds\n", m.saved.size() - 14);
      break;
    }
    o << fmt::format("  {:<56} {:>4} x {:>10} = {:>10}\n", r.what, r.count,
                     human_bytes(double(r.bytes) / double(r.count)), human_bytes(double(r.bytes)));
  }

  const TimePrediction& t = p.time;
  o << (costs.neighbours > 0
            ? fmt::format("\nstep time per rank (each op as measured on this machine, beside {} "
                          "other rank{} running it):\n",
                          costs.neighbours, costs.neighbours == 1 ? "" : "s")
            : std::string("\nstep time per rank (each op as measured on this machine):\n"));
  // The costliest kinds of op: by primitive, with their count and rate.
  struct Kind {
    double seconds = 0, flops = 0;
    int64_t count = 0;
  };
  std::map<std::string, Kind> kinds;
  for (const OpRecord& op : m.ops) {
    if (op.view) continue;
    Kind& k = kinds[std::string(op.primitive->name())];
    k.seconds += op_seconds(op, costs);
    k.flops += op.cost.flops;
    ++k.count;
  }
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [name, k] : kinds) rows.emplace_back(k.seconds, name);
  std::sort(rows.rbegin(), rows.rend());
  for (size_t i = 0; i < rows.size() && i < 10; ++i) {
    const Kind& k = kinds.at(rows[i].second);
    o << fmt::format(
        "  {:<32} {:>5} x {:>9.3f} ms = {:>9.2f} ms{}\n", rows[i].second, k.count,
        k.seconds / double(k.count) * 1e3, k.seconds * 1e3,
        k.flops > 0 ? fmt::format("  {:7.1f} GFLOP/s", k.flops / k.seconds * 1e-9) : std::string());
  }
  if (rows.size() > 10) o << fmt::format("  ... {} more kinds of op\n", rows.size() - 10);
  o << fmt::format("  {:<44} {:>8.2f} ms  ({:.2f} GFLOP per step)\n", "products",
                   t.products_s * 1e3, t.flops * 1e-9);
  o << fmt::format("  {:<44} {:>8.2f} ms\n",
                   s.flash ? "attention (flash kernels)" : "attention (naive kernels)",
                   t.attention_s * 1e3);
  o << fmt::format("  {:<44} {:>8.2f} ms  (bandwidth {:.1f} GB/s from memory)\n",
                   "memory-bound kernels and the update", t.memory_s * 1e3, costs.bandwidth.dram());
  if (s.offload == "disk") {
    int64_t disk_bytes = 0;
    for (const OpRecord& op : m.ops) disk_bytes += op.cost.disk_read + op.cost.disk_written;
    o << fmt::format(
        "  {:<44} {:>8.2f} ms  ({} of {} read and written; disk {:.2f} GB/s read, {:.2f} "
        "write, {:.2f} update: {})\n",
        "offloaded update (streaming its files)", t.disk_s * 1e3, human_bytes(double(disk_bytes)),
        s.offload_master ? "moments and masters" : "moments", costs.disk.read_gbs,
        costs.disk.write_gbs, costs.disk.update_gbs, costs.disk.source);
  }
  o << fmt::format("  {:<44} {:>8.2f} ms  ({} ops x {:.2f} us)\n", "op dispatch",
                   t.overhead_s * 1e3, m.ops.size(), costs.op_overhead_s * 1e6);
  if (s.ranks > 1)
    o << fmt::format(
        "  {:<44} {:>8.2f} ms  ({:.2f} ms of {:.2f} ms not hidden by backward; link {:.2f} GB/s, "
        "{:.1f} us, {})\n",
        "communication", t.comm_exposed_s * 1e3, t.comm_exposed_s * 1e3, t.comm_s * 1e3,
        link.bandwidth_gbs, link.latency_us, link.source);
  o << fmt::format("  {:<44} {:>8.2f} ms  -> {:.0f} tokens/s{}\n", "step", t.step_s * 1e3,
                   t.tokens_per_s, s.ranks > 1 ? " over all ranks" : "");
  if (!scale.empty()) {
    o << fmt::format(
        "\nscaling projection (batch per rank unchanged; ring all-reduce 2(N-1)/N bytes/bandwidth "
        "+ 2(N-1) latency, overlapped with backward bucket by bucket; link {:.2f} GB/s, {:.1f} us: "
        "{}):\n",
        link.bandwidth_gbs, link.latency_us, link.source);
    o << fmt::format("  {:>6} {:>14} {:>11} {:>10} {:>16} {:>12}\n", "ranks", "tokens/s",
                     "efficiency", "step ms", "exposed comm ms", "peak/rank");
    for (const ScalingRow& r : scale)
      o << fmt::format("  {:>6} {:>14.0f} {:>10.1f}% {:>10.2f} {:>16.2f} {:>12}\n", r.ranks,
                       r.tokens_per_s, r.efficiency * 100, r.step_ms, r.comm_exposed_ms,
                       human_bytes(double(r.peak_bytes)));
  }
  return o.str();
}

std::string result_line(const Prediction& p) {
  return fmt::format("RESULT peak_mib={:.1f} step_ms={:.2f} tokens_per_s={:.1f} fits={}",
                     mib(p.step.peak_bytes), p.time.step_s * 1e3, p.time.tokens_per_s,
                     p.fits() ? "yes" : "no");
}

}  // namespace kuai::plan
