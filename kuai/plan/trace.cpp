// A training step on meta tensors, recorded (see trace.h).
#include "kuai/plan/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>

#include "kuai/core/autograd.h"
#include "kuai/core/backend.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/ops.h"
#include "kuai/data/loader.h"

namespace kuai::plan {
namespace {

size_t use_index(MemoryUse u) { return static_cast<size_t>(u); }

std::string layout_text(const Layout& l) {
  std::string s = fmt::format("{}[{}]", dtype_name(l.dtype), fmt::join(l.shape, ","));
  if (l.strides != contiguous_strides(l.shape) || l.offset != 0)
    s += fmt::format("/s{}+{}", fmt::join(l.strides, ","), l.offset);
  return s;
}

// The recorder: a dispatch mode that sees every op of the training thread (and evaluates it on
// meta, adding the scratch the caller states), and an allocation observer that accounts every
// meta block by its use.
class Recorder final : public DispatchMode, public AllocationObserver {
 public:
  explicit Recorder(const TraceTarget& target) : target_(target) {}

  StepTrace trace;

  void begin_step(int64_t step, int64_t steps, bool record) {
    step_ = step;
    steps_ = steps;
    gathering_.clear();
    micro_ = 0;
    recording_ = record;
  }
  void collective(const dist::CollectiveRecord& c) {
    if (!recording_) return;
    trace.collectives.push_back({c, trace.ops.size()});
    if (c.op == "all_gather" && c.buffer != nullptr)
      gathering_[c.buffer] = trace.collectives.size() - 1;
  }
  UseBytes live_by_use() {
    std::lock_guard<std::mutex> lock(mu_);
    return current_;
  }

  // ---- DispatchMode ----
  void transform_inputs(const Primitive& p, std::vector<Tensor>&) override { stack_.push_back(&p); }

  bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override {
    if (!stack_.empty()) stack_.pop_back();
    // A capture on meta (compile) records the step without running it: nothing to evaluate or
    // account; the replay that follows evaluates the graph itself (its memory is observed).
    for (const DispatchMode* m : active_modes())
      if (m->dry()) return false;
    // The first op reading what an all_gather fills is where the step waits for it.
    if (recording_ && !gathering_.empty())
      for (const Tensor& t : in)
        if (t.defined() && t.has_storage())
          if (auto it = gathering_.find(t.storage().get()); it != gathering_.end()) {
            trace.collectives[it->second].needed_at = trace.ops.size();
            gathering_.erase(it);
          }
    const bool backward = autograd::backward_in_progress();
    phase(backward);
    OpRecord r;
    if (recording_ || target_.extra_scratch) r = describe(p, in, out, backward);
    if (!backward && autograd::GradMode::enabled() && !p.updates_in_place()) note_saved(p, in, out);
    if (!p.is_view()) {
      const Primitive* outer = running_;
      running_ = &p;
      evaluate(p, in, out);
      if (target_.extra_scratch && !p.host_side()) {
        const int64_t extra = target_.extra_scratch(r);
        if (extra > 0) {
          const MemoryUseScope workspace(MemoryUse::kWorkspace);
          void* b = Allocator::get().allocate(static_cast<size_t>(extra), kMeta);
          Allocator::get().deallocate(b, static_cast<size_t>(extra), kMeta);
        }
      }
      running_ = outer;
    }
    if (recording_) trace.ops.push_back(std::move(r));
    return true;  // evaluated here (views: nothing to evaluate)
  }

  // ---- AllocationObserver ----
  void on_allocate(void* block, int64_t capacity, Device device, MemoryUse use) override {
    if (device.type != DeviceType::kMeta || use == MemoryUse::kCaptured) return;
    if (use == MemoryUse::kOther)
      use = autograd::backward_in_progress() ? MemoryUse::kActGrads : MemoryUse::kActivations;
    std::lock_guard<std::mutex> lock(mu_);
    live_[block] = Block{capacity, use, next_id_++};
    current_[use_index(use)] += capacity;
    total_ += capacity;
    if (use == MemoryUse::kWorkspace) trace.workspace_max = std::max(trace.workspace_max, capacity);
    if (total_ > trace.peak_bytes) {
      trace.peak_bytes = total_;
      trace.at_peak = current_;
      const Primitive* p = running_ ? running_ : (stack_.empty() ? nullptr : stack_.back());
      peak_op_ = p ? std::string(p->name()) : std::string();
      peak_backward_ = autograd::backward_in_progress();
      peak_step_ = step_;
      peak_micro_ = micro_;
    }
  }
  void on_free(void* block, Device device) override {
    if (device.type != DeviceType::kMeta) return;
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = live_.find(block);
    if (it == live_.end()) return;
    current_[use_index(it->second.use)] -= it->second.capacity;
    total_ -= it->second.capacity;
    live_.erase(it);
  }
  void on_use(void* block, Device device, MemoryUse use) override {
    if (device.type != DeviceType::kMeta) return;
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = live_.find(block);
    if (it == live_.end()) return;
    current_[use_index(it->second.use)] -= it->second.capacity;
    it->second.use = use;
    current_[use_index(use)] += it->second.capacity;
  }

  std::string peak_where() const {
    return fmt::format("{}{}, micro-batch {} of {}, step {} of {}",
                       peak_backward_ ? "backward" : "forward or update",
                       peak_op_.empty() ? "" : " (" + peak_op_ + ")",
                       std::max<int64_t>(1, peak_micro_), target_.accum, peak_step_ + 1, steps_);
  }

 private:
  struct Block {
    int64_t capacity = 0;
    MemoryUse use = MemoryUse::kOther;
    int64_t id = 0;
  };
  struct Saved {
    std::string what;
    void* block = nullptr;
    int64_t id = 0;
  };

  OpRecord describe(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out,
                    bool backward) {
    OpRecord r;
    r.primitive = p.shared_from_this();
    r.backward = backward;
    r.view = p.is_view();
    std::string key(p.name());
    key += "(";
    for (const Tensor& t : in) {
      Layout l;
      l.shape = t.shape();
      l.strides = t.strides();
      l.offset = t.offset();
      l.dtype = t.dtype();
      l.storage_elements =
          t.has_storage() ? static_cast<int64_t>(t.storage()->nbytes) / dtype_size(t.dtype()) : 0;
      if (t.has_storage()) {
        std::lock_guard<std::mutex> lock(mu_);
        const auto it = live_.find(t.storage()->data);
        l.weight = it != live_.end() && (it->second.use == MemoryUse::kParameters ||
                                         it->second.use == MemoryUse::kWeightCasts);
      }
      key += layout_text(l) + " ";
      r.in.push_back(std::move(l));
    }
    key += ")->";
    for (const Tensor& t : out) {
      r.out.push_back({t.shape(), t.dtype()});
      key += fmt::format("{}[{}] ", dtype_name(t.dtype()), fmt::join(t.shape(), ","));
    }
    r.key = std::move(key);
    const std::span<const Tensor> outs(out.data(), out.size());
    r.cost = p.cost(in, outs);
    if (!r.view)
      for (int64_t b : p.cpu_scratch(in, outs)) r.formula_scratch += b;
    return r;
  }

  // Forward -> backward: the last micro-batch's saved tensors are what autograd holds now.
  void phase(bool backward) {
    if (backward && !backward_) {
      ++micro_;
      if (recording_) snapshot_saved();
    } else if (!backward && backward_) {
      saved_.clear();
    }
    backward_ = backward;
  }

  void note_saved(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) {
    bool recorded = false;
    for (const Tensor& t : in) recorded = recorded || t.requires_grad();
    if (!recorded) return;
    auto keep = [&](const Tensor& t, const std::string& slot) {
      if (!t.has_storage()) return;
      std::lock_guard<std::mutex> lock(mu_);
      const auto it = live_.find(t.storage()->data);
      if (it == live_.end()) return;
      saved_.push_back({fmt::format("{} {} ({})", p.name(), slot, dtype_name(t.dtype())),
                        t.storage()->data, it->second.id});
    };
    for (size_t i = 0; i < in.size(); ++i)
      if (p.saves_input(i)) keep(in[i], fmt::format("input {}", i));
    for (size_t j = 0; j < out.size(); ++j)
      if (p.saves_output(j)) keep(out[j], fmt::format("output {}", j));
  }

  void snapshot_saved() {
    std::map<std::string, SavedRow> rows;
    std::unordered_map<int64_t, bool> seen;
    int64_t total = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const Saved& s : saved_) {
        const auto it = live_.find(s.block);
        if (it == live_.end() || it->second.id != s.id || seen[s.id]) continue;
        if (it->second.use != MemoryUse::kActivations) continue;  // weights, their casts
        seen[s.id] = true;
        SavedRow& r = rows[s.what];
        r.what = s.what;
        ++r.count;
        r.bytes += it->second.capacity;
        total += it->second.capacity;
      }
    }
    trace.saved.clear();
    for (auto& [what, r] : rows) trace.saved.push_back(r);
    std::sort(trace.saved.begin(), trace.saved.end(),
              [](const SavedRow& a, const SavedRow& b) { return a.bytes > b.bytes; });
    trace.saved_total = total;
  }

  const TraceTarget& target_;
  std::unordered_map<const void*, size_t> gathering_;  // storage -> its all_gather in flight
  std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  UseBytes current_{};
  int64_t total_ = 0, next_id_ = 0;
  std::vector<const Primitive*> stack_;  // ops whose outputs are being allocated
  const Primitive* running_ = nullptr;   // the op being evaluated (its scratch)
  std::vector<Saved> saved_;
  bool backward_ = false, recording_ = false;
  int64_t step_ = 0, steps_ = 1, micro_ = 0;
  std::string peak_op_;
  bool peak_backward_ = false;
  int64_t peak_step_ = 0, peak_micro_ = 0;
};

// Installs the observer for the trace's lifetime.
class ObserverGuard {
 public:
  explicit ObserverGuard(AllocationObserver* o) { set_allocation_observer(o); }
  ~ObserverGuard() { set_allocation_observer(nullptr); }
  ObserverGuard(const ObserverGuard&) = delete;
  ObserverGuard& operator=(const ObserverGuard&) = delete;
};

}  // namespace

namespace {

using Build = std::function<std::unique_ptr<train::StepParts>(std::shared_ptr<dist::ProcessGroup>)>;

StepTrace trace_with(const TraceTarget& target, const Build& build) {
  constexpr int64_t kSteps = 2;
  Recorder rec(target);
  Allocator::get().empty_cache(kMeta);  // the trace's blocks only, as a fresh run's
  const ObserverGuard observing(&rec);
  const DeviceGuard meta(kMeta);
  auto group = dist::recording_process_group(
      target.world, 0, [&rec](const dist::CollectiveRecord& c) { rec.collective(c); });
  const ModeGuard mode(rec);
  std::unique_ptr<train::StepParts> parts = build(group);
  std::vector<data::Batch> slots;
  {
    const MemoryUseScope data(MemoryUse::kData);
    for (int64_t i = 0; i < std::max<int64_t>(1, target.loader_slots); ++i)
      slots.push_back({zeros({target.batch, target.seq}, DType::kI32),
                       zeros({target.batch, target.seq}, DType::kI32), i});
  }
  for (int64_t step = 0; step < kSteps; ++step) {
    rec.begin_step(step, kSteps, step == kSteps - 1);
    std::vector<data::Batch> micro;
    for (int64_t m = 0; m < target.accum; ++m)
      micro.push_back(slots[static_cast<size_t>((step * target.accum + m) %
                                                static_cast<int64_t>(slots.size()))]);
    parts->step->step(micro);
  }
  StepTrace t = std::move(rec.trace);
  t.persistent = rec.live_by_use();
  t.peak_where = rec.peak_where();
  t.tokens = target.batch * target.seq * target.accum;
  return t;
}

}  // namespace

StepTrace trace_step(const TraceTarget& target) {
  StepTrace t = trace_with(target, target.build);
  if (!target.build_compiled) return t;
  // train.compile: the memory is the compiled step's. The capture records on meta (its values
  // are not the step's memory), the replay runs in the arena its plan sets; what the replay
  // takes from the allocator beside it is its outputs and the products' scratch (not planned:
  // their formula is not stated), counted here as the largest product's.
  const StepTrace c = trace_with(target, target.build_compiled);
  int64_t product_scratch = 0;
  if (target.extra_scratch)
    for (const OpRecord& op : t.ops)
      if (!op.view && !op.primitive->host_side())
        product_scratch = std::max(product_scratch, target.extra_scratch(op));
  t.peak_bytes = c.peak_bytes + product_scratch;
  t.at_peak = c.at_peak;
  t.at_peak[use_index(MemoryUse::kWorkspace)] += product_scratch;
  t.persistent = c.persistent;
  t.peak_where = "the compiled step's replay, in the arena its memory plan sets";
  t.compiled = true;
  return t;
}

TraceTarget target_for(const train::TrainConfig& cfg, int64_t ranks) {
  TraceTarget t;
  train::TrainConfig c = cfg;
  c.compile = false;  // the ops and their times: the eager step's
  t.build = [c](std::shared_ptr<dist::ProcessGroup> group) {
    return train::build_step_parts(c, std::move(group), train::step_options(c));
  };
  if (cfg.compile)  // the memory: the compiled step's
    t.build_compiled = [cfg](std::shared_ptr<dist::ProcessGroup> group) {
      return train::build_step_parts(cfg, std::move(group), train::step_options(cfg));
    };
  t.batch = cfg.batch_size;
  t.seq = cfg.model.seq_len;
  t.accum = cfg.accum_steps;
  t.loader_slots = cfg.workers == 0 ? 1 : cfg.workers * cfg.prefetch_factor;
  t.world = static_cast<int>(ranks);
  return t;
}

}  // namespace kuai::plan
