// ZeRO-3's sharded parameters (see zero3.h).
#include "kuai/distributed/zero3.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "kuai/core/allocator.h"

namespace kuai::dist {

struct ShardedParameters::State {
  struct Unit {
    std::string name;
    std::vector<Tensor> params;
    std::vector<size_t> uses;
    std::shared_ptr<Storage> storage;  // the gathered buffer's; released when not whole
    Tensor flat;                       // (padded) fp32 over it
    Tensor shard;                      // this rank's part: the optimizer's masters
    std::shared_ptr<Work> pending;     // its all-gather, until waited for
    int64_t saved = 0;                 // packed saved tensors over it not yet unpacked
    int whole_guards = 0;              // Whole guards holding it
  };
  std::shared_ptr<ProcessGroup> group;
  Zero3Options options;
  std::vector<Unit> units;
  bool in_backward = false;
  // Packs the saved tensors of the unit whose forward runs (pushed by before(), popped by after()).
  std::unique_ptr<autograd::SavedTensorHooksGuard> packing;
  Stats stats;

  bool whole(size_t u) const { return !units[u].storage->released; }

  void note_whole() {
    size_t n = 0;
    int64_t bytes = 0;
    for (const Unit& x : units)
      if (!x.storage->released) {
        ++n;
        bytes += static_cast<int64_t>(x.storage->nbytes);
      }
    if (n > stats.max_whole) stats.max_whole = n;
    if (bytes > stats.max_whole_bytes) stats.max_whole_bytes = bytes;
  }

  // Issues unit u's all-gather unless it is whole or in flight.
  void gather(size_t u) {
    Unit& x = units[u];
    if (!x.storage->released) return;
    {
      const MemoryUseScope parameters(MemoryUse::kParameters);
      x.storage->materialize();
    }
    x.pending = group->all_gather(x.shard, x.flat);
    ++stats.gathers;
    stats.gathered_bytes += static_cast<int64_t>(x.storage->nbytes);
    if (autograd::backward_in_progress()) ++stats.gathers_in_backward;
    note_whole();
  }

  void wait(size_t u) {
    gather(u);
    if (auto w = std::move(units[u].pending)) w->wait();
  }

  void release(size_t u) {
    Unit& x = units[u];
    if (x.storage->released || x.whole_guards > 0) return;
    if (auto w = std::move(x.pending)) w->wait();  // the collective still writes the bytes
    x.storage->release();
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

std::vector<std::vector<Tensor>> ShardedParameters::bucket_layout(
    const std::vector<nn::ModelUnit>& units) {
  std::vector<std::vector<Tensor>> out;
  for (size_t u = units.size(); u-- > 0;) out.push_back(units[u].params);
  return out;
}

ShardedParameters::ShardedParameters(std::vector<nn::ModelUnit> units, ZeroAdamW& opt,
                                     const Zero3Options& options)
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
  const size_t U = units.size();
  if (opt.num_buckets() != U)
    throw std::invalid_argument(fmt::format(
        "ShardedParameters: the optimizer has {} buckets for {} units", opt.num_buckets(), U));
  const std::vector<Tensor> shards = opt.parameter_shards();
  const int64_t world = s.group->size();
  for (size_t u = 0; u < U; ++u) {
    nn::ModelUnit& mu = units[u];
    const size_t b = U - 1 - u;
    const std::vector<Tensor> bucket = opt.bucket(b);
    bool same = bucket.size() == mu.params.size();
    for (size_t i = 0; same && i < bucket.size(); ++i)
      same = bucket[i].impl() == mu.params[i].impl();
    if (!same)
      throw std::invalid_argument(fmt::format(
          "ShardedParameters: the optimizer's bucket {} is not unit {} ('{}'): build it on "
          "ShardedParameters::bucket_layout(units)",
          b, u, mu.name));
    for (size_t v : mu.uses)
      if (v >= U || v == u)
        throw std::invalid_argument(
            fmt::format("ShardedParameters: unit '{}' uses unit {} of {}", mu.name, v, U));
    State::Unit x;
    x.name = mu.name;
    x.params = mu.params;
    x.uses = mu.uses;
    const int64_t padded = opt.part(b) * world;
    const Device device = mu.params.empty() ? kCPU : mu.params[0].device();
    {
      const MemoryUseScope parameters(MemoryUse::kParameters);
      x.storage = std::make_shared<Storage>(static_cast<size_t>(padded) * sizeof(float), device);
    }
    x.flat = Tensor::in_storage(x.storage, {padded}, DType::kF32, 0);
    x.shard = shards[b];
    // Each parameter becomes a view at its place in the buffer (its old bytes go); its values
    // are in the shards (the optimizer copied them), gathered when the unit runs.
    int64_t offset = 0;
    for (Tensor& p : x.params) {
      if (p.dtype() != DType::kF32 || !p.is_contiguous())
        throw std::invalid_argument("ShardedParameters: parameters must be contiguous fp32");
      TensorImpl* impl = p.impl();
      impl->storage = x.storage;
      impl->offset = offset;
      offset += p.numel();
    }
    x.storage->release();
    s.units.push_back(std::move(x));
  }
}

ShardedParameters::~ShardedParameters() {
  // Gathers still in flight write the buffers: let them finish.
  for (State::Unit& x : state_->units) {
    try {
      if (auto w = std::move(x.pending)) w->wait();
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
      if (s.units[v].saved == 0 && !s.units[v].pending) s.release(v);
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
    if (s.units[u].storage.get() == storage) {
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

void ShardedParameters::for_each_unit_whole(const std::function<void(size_t)>& fn) {
  for (size_t u = 0; u < state_->units.size(); ++u) {
    const Whole whole(*this, {u});
    fn(u);
  }
}

size_t ShardedParameters::num_units() const { return state_->units.size(); }
const std::string& ShardedParameters::unit_name(size_t u) const { return state_->units[u].name; }
const std::vector<Tensor>& ShardedParameters::unit_params(size_t u) const {
  return state_->units[u].params;
}
int64_t ShardedParameters::unit_bytes(size_t u) const {
  return static_cast<int64_t>(state_->units[u].storage->nbytes);
}
bool ShardedParameters::is_whole(size_t u) const { return state_->whole(u); }
const Zero3Options& ShardedParameters::options() const { return state_->options; }
ShardedParameters::Stats ShardedParameters::stats() const { return state_->stats; }
void ShardedParameters::reset_stats() {
  state_->stats = {};
  state_->note_whole();
}

}  // namespace kuai::dist
