// ZeRO-3's sharded parameters (see zero3.h).
#include "kuai/distributed/zero3.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <stdexcept>

#include "kuai/core/allocator.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/ops.h"
#include "kuai/distributed/collective_ops.h"

namespace kuai::dist {

struct ShardedParameters::State {
  // One optimizer bucket of a unit, gathered in one dtype: the unit's parameters in fp32, or (with
  // a low gather dtype) its products' parameters in it and the others in fp32.
  struct Part {
    std::vector<Tensor> params;
    DType dtype = DType::kF32;
    std::shared_ptr<Storage> storage;   // the gathered buffer's; released when not whole
    Tensor flat;                        // (padded) over it, in dtype
    Tensor shard;                       // this rank's part: the optimizer's fp32 masters
    Tensor send;                        // what its gather sends (the shard, or it cast), until done
    std::shared_ptr<WorkSlot> pending;  // its all-gather, until waited for
  };
  struct Unit {
    std::string name;
    std::vector<Tensor> params;
    std::vector<size_t> uses;
    std::vector<Part> parts;
    int64_t saved = 0;     // packed saved tensors over it not yet unpacked
    int whole_guards = 0;  // Whole guards holding it
    // Gathered (or being gathered). The schedule's own record, not the storage's: a step recorded
    // on meta (compile) runs none of the gathers it records, and its decisions must be those of
    // the step it records.
    bool whole = false;
    bool released() const { return !whole; }
    bool pending() const {
      for (const Part& p : parts)
        if (p.pending) return true;
      return false;
    }
    int64_t bytes() const {
      int64_t n = 0;
      for (const Part& p : parts) n += static_cast<int64_t>(p.storage->nbytes);
      return n;
    }
  };
  std::shared_ptr<ProcessGroup> group;
  Zero3Options options;
  std::vector<Unit> units;
  bool in_backward = false;
  // Packs the saved tensors of the unit whose forward runs (pushed by before(), popped by after()).
  std::unique_ptr<autograd::SavedTensorHooksGuard> packing;
  Stats stats;

  bool whole(size_t u) const { return !units[u].released(); }

  void note_whole() {
    size_t n = 0;
    int64_t bytes = 0;
    for (const Unit& x : units)
      if (!x.released()) {
        ++n;
        bytes += x.bytes();
      }
    if (n > stats.max_whole) stats.max_whole = n;
    if (bytes > stats.max_whole_bytes) stats.max_whole_bytes = bytes;
  }

  // Issues unit u's all-gather unless it is whole or in flight. Its buffer's bytes are taken,
  // the gather started, and both dispatched (collective_ops.h), so a captured step repeats them.
  // (A low dtype's gather sends the shard cast to it: the cast runs here, on the compute
  // thread, over 1/N of the unit.)
  void gather(size_t u) {
    Unit& x = units[u];
    if (x.whole) return;
    x.whole = true;
    for (Part& part : x.parts) {
      dispatch(std::make_shared<StorageResize>(true), {part.flat});
      part.send = part.shard;
      if (part.dtype != DType::kF32) {
        const autograd::NoGradGuard no_grad;
        const MemoryUseScope comm(MemoryUse::kComm);
        part.send = cast(part.shard, part.dtype);
      }
      part.pending = all_gather_start(group, part.send, part.flat);
      stats.gathered_bytes += static_cast<int64_t>(part.storage->nbytes);
    }
    ++stats.gathers;
    if (autograd::backward_in_progress()) ++stats.gathers_in_backward;
    note_whole();
  }

  // Waits for part's gather (a dispatched wait, timed into stats().wait_seconds when it runs).
  void finish_gather(Part& part) {
    if (auto slot = std::move(part.pending)) {
      std::weak_ptr<State> weak = self;
      collective_wait(slot, {part.send, part.flat}, [weak](double seconds) {
        if (auto st = weak.lock()) st->stats.wait_seconds += seconds;
      });
    }
    part.send = Tensor();
  }

  void wait(size_t u) {
    gather(u);
    for (Part& part : units[u].parts) finish_gather(part);
  }

  void release(size_t u) {
    Unit& x = units[u];
    if (!x.whole || x.whole_guards > 0) return;
    x.whole = false;
    for (Part& part : x.parts) {
      finish_gather(part);  // the collective still writes the bytes
      dispatch(std::make_shared<StorageResize>(false), {part.flat});
    }
  }

  // The first time unit u is needed in a backward: it and what it reads are whole, the units
  // backward needs next are prefetched, and the units nothing will need again are released.
  void use_in_backward(size_t u) {
    if (!in_backward) {
      in_backward = true;
      std::weak_ptr<State> weak = self;
      autograd::queue_callback([weak] {
        if (auto st = weak.lock()) st->end_backward();
      });
    }
    for (size_t v = 0; v < units.size(); ++v)
      if (v != u && whole(v) && units[v].saved == 0) release(v);
    wait(u);
    // Prefetch: the units before u in forward order that still have saved tensors to unpack.
    int ahead = 0;
    for (size_t v = u; v-- > 0 && ahead < options.prefetch;)
      if (units[v].saved > 0) {
        gather(v);
        ++ahead;
      }
  }

  void end_backward() {
    in_backward = false;
    for (size_t v = 0; v < units.size(); ++v)
      if (units[v].saved == 0) release(v);
  }

  std::weak_ptr<State> self;
};

namespace {

// A saved view of a unit's parameters: the node keeps the view (its storage, without bytes);
// unpacking makes the unit whole first.
class SavedUnitTensor final : public autograd::SavedTensor {
 public:
  SavedUnitTensor(std::weak_ptr<ShardedParameters::State> state, size_t unit, Tensor saved)
      : state_(std::move(state)), unit_(unit), saved_(std::move(saved)) {}
  ~SavedUnitTensor() override {
    if (done_) return;
    if (auto st = state_.lock()) --st->units[unit_].saved;
  }
  Tensor unpack() override {
    auto st = state_.lock();
    if (!st)
      throw std::runtime_error(
          "ZeRO-3: a saved parameter's sharded owner is gone before the backward that needs it");
    if (!done_) {
      done_ = true;
      st->use_in_backward(unit_);
      --st->units[unit_].saved;
    } else {
      st->wait(unit_);
    }
    return saved_;
  }

 private:
  std::weak_ptr<ShardedParameters::State> state_;
  size_t unit_;
  Tensor saved_;
  bool done_ = false;
};

}  // namespace

namespace {

// A unit's parameters split by gather dtype: those in `low` first (if any), then the others (if
// any); without low parameters, one part of them all.
std::vector<std::vector<Tensor>> unit_parts(const nn::ModelUnit& unit,
                                            const std::set<const TensorImpl*>& low) {
  std::vector<Tensor> in_low, rest;
  for (const Tensor& p : unit.params) (low.count(p.impl()) ? in_low : rest).push_back(p);
  std::vector<std::vector<Tensor>> out;
  if (!in_low.empty()) out.push_back(std::move(in_low));
  if (!rest.empty() || out.empty()) out.push_back(std::move(rest));
  return out;
}

std::set<const TensorImpl*> impl_set(const std::vector<Tensor>& tensors) {
  std::set<const TensorImpl*> out;
  for (const Tensor& t : tensors) out.insert(t.impl());
  return out;
}

}  // namespace

std::vector<std::vector<Tensor>> ShardedParameters::bucket_layout(
    const std::vector<nn::ModelUnit>& units, const std::vector<Tensor>& low) {
  const std::set<const TensorImpl*> low_set = impl_set(low);
  std::vector<std::vector<Tensor>> out;
  for (size_t u = units.size(); u-- > 0;)
    for (std::vector<Tensor>& part : unit_parts(units[u], low_set)) out.push_back(std::move(part));
  return out;
}

ShardedParameters::ShardedParameters(std::vector<nn::ModelUnit> units, ZeroAdamW& opt,
                                     const Zero3Options& options, const std::vector<Tensor>& low)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.self = state_;
  s.group = opt.process_group();
  s.options = options;
  if (opt.stage() != 3)
    throw std::invalid_argument(
        fmt::format("ShardedParameters: the optimizer is ZeRO stage {}, not 3", opt.stage()));
  if (options.prefetch < 0)
    throw std::invalid_argument(
        fmt::format("ShardedParameters: prefetch must be >= 0, got {}", options.prefetch));
  const bool low_dtype = options.gather_dtype != DType::kF32;
  if (low_dtype && options.gather_dtype != DType::kBF16 && options.gather_dtype != DType::kF16)
    throw std::invalid_argument(
        fmt::format("ShardedParameters: gather dtype must be float32, bfloat16 or float16, got {}",
                    dtype_name(options.gather_dtype)));
  if (!low_dtype && !low.empty())
    throw std::invalid_argument(
        "ShardedParameters: parameters to gather in a low dtype, but the gather dtype is float32");
  const std::set<const TensorImpl*> low_set = impl_set(low);
  const size_t U = units.size();
  std::vector<std::vector<std::vector<Tensor>>> parts(U);
  size_t buckets = 0;
  for (size_t u = 0; u < U; ++u) {
    parts[u] = unit_parts(units[u], low_set);
    buckets += parts[u].size();
  }
  if (opt.num_buckets() != buckets)
    throw std::invalid_argument(
        fmt::format("ShardedParameters: the optimizer has {} buckets for {} units in {} parts: "
                    "build it on ShardedParameters::bucket_layout(units, low)",
                    opt.num_buckets(), U, buckets));
  const std::vector<Tensor> shards = opt.parameter_shards();
  const int64_t world = s.group->size();
  size_t later = buckets;  // buckets of the units after u (bucket_layout: the last unit first)
  for (size_t u = 0; u < U; ++u) {
    nn::ModelUnit& mu = units[u];
    for (size_t v : mu.uses)
      if (v >= U || v == u)
        throw std::invalid_argument(
            fmt::format("ShardedParameters: unit '{}' uses unit {} of {}", mu.name, v, U));
    later -= parts[u].size();
    State::Unit x;
    x.name = mu.name;
    x.params = mu.params;
    x.uses = mu.uses;
    for (size_t k = 0; k < parts[u].size(); ++k) {
      const size_t b = later + k;
      const std::vector<Tensor> bucket = opt.bucket(b);
      const std::vector<Tensor>& want = parts[u][k];
      bool same = bucket.size() == want.size();
      for (size_t i = 0; same && i < bucket.size(); ++i) same = bucket[i].impl() == want[i].impl();
      if (!same)
        throw std::invalid_argument(fmt::format(
            "ShardedParameters: the optimizer's bucket {} is not part {} of unit {} ('{}'): build "
            "it on ShardedParameters::bucket_layout(units, low)",
            b, k, u, mu.name));
      State::Part part;
      part.params = want;
      part.dtype =
          !want.empty() && low_set.count(want[0].impl()) ? options.gather_dtype : DType::kF32;
      const int64_t padded = opt.part(b) * world;
      // Where the shard is (the parameters may have been built on meta, without values).
      const Device device = shards[b].device();
      {
        const MemoryUseScope parameters(MemoryUse::kParameters);
        part.storage = std::make_shared<Storage>(
            Storage::Released{}, static_cast<size_t>(padded * dtype_size(part.dtype)), device);
      }
      part.flat = Tensor::in_storage(part.storage, {padded}, part.dtype, 0);
      part.shard = shards[b];
      // Each parameter becomes a view at its place in the buffer (its old bytes go); its values
      // are in the shards (the optimizer copied them), gathered when the unit runs. One gathered
      // in a low dtype is a working copy whose fp32 master is the shard: only products read it
      // (autocast's check), its gradient stays fp32 (TensorImpl::master_elsewhere).
      int64_t offset = 0;
      for (const Tensor& p : part.params) {
        if (p.dtype() != DType::kF32 || !p.is_contiguous() || !p.is_leaf())
          throw std::invalid_argument(
              "ShardedParameters: parameters must be contiguous fp32 leaves, got " + p.str());
        TensorImpl* impl = p.impl();
        impl->storage = part.storage;
        impl->device = device;
        impl->offset = offset;
        impl->dtype = part.dtype;
        impl->master_elsewhere = part.dtype != DType::kF32;
        offset += p.numel();
      }
      x.parts.push_back(std::move(part));
    }
    s.units.push_back(std::move(x));
  }
}

ShardedParameters::~ShardedParameters() {
  // Gathers still in flight write the buffers: let them finish.
  for (State::Unit& x : state_->units)
    for (State::Part& part : x.parts) {
      try {
        if (auto slot = std::move(part.pending))
          if (auto w = std::move(slot->work)) w->wait();
      } catch (const std::exception&) {
      }
    }
}

void ShardedParameters::before(size_t u) {
  State& s = *state_;
  if (u >= s.units.size())
    throw std::out_of_range(fmt::format("ZeRO-3: unit {} of {}", u, s.units.size()));
  // A new forward: units a discarded graph left whole (nothing to unpack any more) go.
  if (u == 0 && !s.in_backward)
    for (size_t v = 1; v < s.units.size(); ++v)
      if (s.units[v].saved == 0 && !s.units[v].pending()) s.release(v);
  s.wait(u);
  for (size_t v : s.units[u].uses) s.wait(v);
  for (size_t v = u + 1; v < s.units.size() && v <= u + static_cast<size_t>(s.options.prefetch);
       ++v)
    s.gather(v);
  if (autograd::GradMode::enabled())
    s.packing = std::make_unique<autograd::SavedTensorHooksGuard>(*this);
}

void ShardedParameters::after(size_t u) {
  State& s = *state_;
  s.packing.reset();
  // Kept for backward: everything (reshard_after_forward off), or the last unit, which backward
  // needs first; nothing outside grad mode.
  const bool grad = autograd::GradMode::enabled();
  if (grad && (!s.options.reshard_after_forward || u + 1 == s.units.size())) return;
  s.release(u);
  for (size_t v : s.units[u].uses) s.release(v);
}

std::shared_ptr<autograd::SavedTensor> ShardedParameters::pack(const Tensor& saved) {
  if (!saved.has_storage()) return nullptr;
  State& s = *state_;
  const Storage* storage = saved.storage().get();
  for (size_t u = 0; u < s.units.size(); ++u)
    for (const State::Part& part : s.units[u].parts)
      if (part.storage.get() == storage) {
        ++s.units[u].saved;
        return std::make_shared<SavedUnitTensor>(state_, u, saved.detach());
      }
  return nullptr;
}

ShardedParameters::Whole::Whole(ShardedParameters& owner, std::vector<size_t> units)
    : owner_(owner), units_(std::move(units)) {
  State& s = *owner_.state_;
  for (size_t u : units_) s.gather(u);
  for (size_t u : units_) {
    s.wait(u);
    ++s.units[u].whole_guards;
  }
}

ShardedParameters::Whole::~Whole() {
  State& s = *owner_.state_;
  for (size_t u : units_) --s.units[u].whole_guards;
  for (size_t u : units_)
    if (s.units[u].saved == 0) s.release(u);
}

void ShardedParameters::for_each_unit_values(
    const std::function<void(const Tensor& param, const float* values)>& fn) {
  State& s = *state_;
  for (size_t u = 0; u < s.units.size(); ++u) {
    const Whole whole(*this, {u});
    for (State::Part& part : s.units[u].parts) {
      Tensor values = part.flat;
      if (part.dtype != DType::kF32) {  // the masters, not their working copy
        const MemoryUseScope comm(MemoryUse::kComm);
        values = Tensor::empty({part.flat.numel()});
        all_gather(s.group, part.shard, values);
      }
      const float* v = values.device_data<float>();
      for (const Tensor& p : part.params) {
        fn(p, v);
        v += p.numel();
      }
    }
  }
}

size_t ShardedParameters::num_units() const { return state_->units.size(); }
const std::string& ShardedParameters::unit_name(size_t u) const { return state_->units[u].name; }
const std::vector<Tensor>& ShardedParameters::unit_params(size_t u) const {
  return state_->units[u].params;
}
int64_t ShardedParameters::unit_bytes(size_t u) const { return state_->units[u].bytes(); }
bool ShardedParameters::is_whole(size_t u) const { return state_->whole(u); }
const Zero3Options& ShardedParameters::options() const { return state_->options; }
ShardedParameters::Stats ShardedParameters::stats() const { return state_->stats; }
void ShardedParameters::reset_stats() {
  state_->stats = {};
  state_->note_whole();
}

}  // namespace kuai::dist
