// The DDP reducer (see ddp.h).
#include "kuai/distributed/ddp.h"

#include "kuai/core/allocator.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>

#include "kuai/core/backend.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/dtype.h"
#include "kuai/core/ops.h"
#include "kuai/core/primitives.h"
#include "kuai/distributed/collective_ops.h"

namespace kuai::dist {

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone:
      return "none";
    case Compression::kFp16:
      return "fp16";
    case Compression::kBf16:
      return "bf16";
  }
  return "?";
}

Compression parse_compression(const std::string& name) {
  for (Compression c : {Compression::kNone, Compression::kFp16, Compression::kBf16})
    if (name == compression_name(c)) return c;
  throw std::invalid_argument("DDP: unknown compression '" + name +
                              "' (one of \"none\", \"fp16\", \"bf16\")");
}

struct DistributedDataParallel::State {
  std::shared_ptr<ProcessGroup> group;
  DDPOptions options;
  std::vector<Bucket> buckets;
  std::vector<int64_t> padded;         // per bucket: flat.numel(), a multiple of the world size
  std::vector<Tensor> wire, residual;  // per bucket, with compression
  std::vector<Tensor> shards;          // per bucket, ZeRO-2 (empty otherwise)
  // Sharded with compression: per bucket, the wire copies of a reduce-scatter in flight (the
  // whole bucket, cast, and this rank's part of the sum), held until it completes.
  std::vector<Tensor> wire_in, wire_out;
  // Sharded, every micro-batch: each backward reduce-scatters; after the step's first, into
  // temp[b] (a shard's size, held until its collective completes), then added into shards[b].
  bool every_micro_batch = false;
  bool accumulating = false;                  // a micro-batch of this step is already in the shards
  std::vector<Tensor> temp;                   // per bucket
  std::vector<int64_t> bucket_of;             // parameter index -> bucket
  std::vector<int64_t> offset;                // parameter index -> first element in its bucket
  std::vector<std::string> names;             // parameter index -> name
  std::vector<Tensor> params;                 // parameter index -> parameter
  std::vector<std::vector<int64_t>> members;  // per bucket, parameter indices
  // Per synchronising backward:
  bool sync = true;              // the step's last micro-batch
  bool communicate = true;       // this backward's buckets go out (sync, or every_micro_batch)
  bool open = false;             // a communicating backward was prepared and not yet finished
  std::vector<int64_t> pending;  // parameters of each bucket not yet ready
  std::vector<char> ready;       // per parameter
  size_t next_launch = 0;        // buckets are launched in order
  // Per launched bucket, in bucket order: the slot its collective's Work is in; sharded, whether
  // it was waited for and its memory released (finish_bucket).
  std::vector<std::shared_ptr<WorkSlot>> works;
  std::vector<char> done;

  bool sharded() const { return !shards.empty(); }

  void reset_for_backward() {
    pending.resize(members.size());
    for (size_t b = 0; b < members.size(); ++b)
      pending[b] = static_cast<int64_t>(members[b].size());
    std::fill(ready.begin(), ready.end(), 0);
    next_launch = 0;
    works.clear();
    done.clear();
  }

  // The bucket's memory, zeroed, with its parameters' gradients as views into it.
  void allocate(size_t b) {
    const MemoryUseScope gradients(MemoryUse::kGradients);
    buckets[b].flat = zeros({padded[b]});
    for (int64_t i : members[b]) allocate_view(i);
  }

  // ZeRO-2: a gradient that autograd put somewhere else than the bucket (the first one of an
  // unallocated bucket, adopted as it came) is moved into the bucket.
  void place(int64_t param, const Tensor& g) {
    const size_t b = static_cast<size_t>(bucket_of[param]);
    Tensor& p = params[param];
    const Tensor cur = p.grad();  // before allocate() points it into the bucket
    if (!buckets[b].flat.defined()) allocate(b);
    if (cur.defined() && cur.has_storage() && cur.storage() == buckets[b].flat.storage()) return;
    const Tensor src = cur.defined() ? cur : g;
    allocate_view(param);
    assign_(p.grad(), src);  // into the bucket (dispatched: a captured step repeats it)
  }
  void allocate_view(int64_t param) {
    Tensor& p = params[param];
    const size_t b = static_cast<size_t>(bucket_of[param]);
    p.set_grad(
        Tensor::view_of(buckets[b].flat, p.shape(), contiguous_strides(p.shape()), offset[param]));
  }

  // ZeRO-2/3: what bucket b's reduce-scatter reads and writes, named by its start and wait: the
  // bucket, the shard it goes to (or the temporary of a later micro-batch), and with compression
  // the wire copies and the error feedback's residual.
  std::vector<Tensor> scattered(size_t b) const {
    std::vector<Tensor> t = {buckets[b].flat, temp[b].defined() ? temp[b] : shards[b]};
    if (options.compression == Compression::kNone) return t;
    t.push_back(wire_in[b]);
    t.push_back(wire_out[b]);
    if (!residual.empty()) t.push_back(residual[b]);
    return t;
  }

  // ZeRO-2/3: bucket b's reduce-scatter is waited for, and the bucket gives its memory back (a
  // micro-batch after the step's first adds what it received into the shard).
  void finish_bucket(size_t b) {
    if (done[b]) return;
    done[b] = 1;
    collective_wait(works[b], scattered(b));
    for (Tensor& p : buckets[b].params) p.set_grad(Tensor());
    buckets[b].flat = Tensor();
    wire_in[b] = wire_out[b] = Tensor();
    if (temp[b].defined()) {
      add_(shards[b], temp[b]);
      temp[b] = Tensor();
    }
  }

  // Bucket i - kInFlight is finished (waited for) as bucket i is launched, so at most
  // kInFlight + 1 buckets are whole at once whatever the link's speed: a bound on the gradients'
  // memory (FSDP's rate limit), and a fixed schedule that a captured step repeats and that
  // `kuai plan`'s trace follows (its collectives complete when waited for). Eager, the buckets
  // whose reduce-scatter has completed are finished earlier still, as backward goes on; a step
  // being recorded (compile's capture, which may not run the collectives at all) keeps to the
  // fixed schedule alone.
  static constexpr size_t kInFlight = 2;
  void release_completed() {
    for (size_t b = 0; b + kInFlight < works.size(); ++b) finish_bucket(b);
    if (recording()) return;
    for (size_t b = 0; b < works.size(); ++b)
      if (!done[b] && works[b]->work && works[b]->work->is_completed()) finish_bucket(b);
  }

  // What bucket i's all-reduce writes, named by its start and wait primitives: the bucket, and
  // with compression its wire copy and the error-feedback residual the hooks update.
  std::vector<Tensor> all_reduced(size_t i) const {
    std::vector<Tensor> t = {buckets[i].flat};
    if (options.compression != Compression::kNone) t.push_back(wire[i]);
    if (!residual.empty()) t.push_back(residual[i]);
    return t;
  }

  void launch_ready() {
    while (next_launch < buckets.size() && pending[next_launch] == 0) {
      const size_t i = next_launch++;
      if (!buckets[i].flat.defined()) allocate(i);  // find_unused: a bucket nobody touched
      if (sharded()) {  // ZeRO-2/3: dispatched as well (collective_ops.h)
        done.push_back(0);
        if (accumulating) {
          const MemoryUseScope gradients(MemoryUse::kGradients);
          temp[i] = zeros(shards[i].shape(), DType::kF32, shards[i].device());
        }
        if (options.compression == Compression::kNone) {
          works.push_back(reduce_scatter_start(group, scattered(i)));
          continue;
        }
        // Compressed: the bucket (divided by the world size, plus the error feedback's residual)
        // is cast into a wire copy on the communication thread, reduce-scattered in the wire
        // dtype (each sum in fp32, rounded once, as the all-reduce does), and this rank's part
        // widened into the shard: the numbers DDP's compressed all-reduce gives this rank.
        const DType wt = options.compression == Compression::kBf16 ? DType::kBF16 : DType::kF16;
        {
          const MemoryUseScope comm(MemoryUse::kComm);
          wire_in[i] = zeros({padded[i]}, wt, shards[i].device());
          wire_out[i] = zeros(shards[i].shape(), wt, shards[i].device());
        }
        works.push_back(reduce_scatter_start(group, scattered(i), wt));
        continue;
      }
      // Dispatched, so a captured step holds its collectives (collective_ops.h).
      auto slot = std::make_shared<WorkSlot>();
      works.push_back(slot);
      if (options.compression == Compression::kNone) {
        dispatch(std::make_shared<AllReduceStart>(group, ReduceOp::kAvg, slot), all_reduced(i));
        continue;
      }
      // The wire copy goes through the collective; the hooks cast the bucket into and out of it.
      const Compressor c{buckets[i].flat.device_data<float>(),
                         wire[i].device_data<uint16_t>(),
                         residual.empty() ? nullptr : residual[i].device_data<float>(),
                         buckets[i].flat.numel(),
                         wire[i].dtype(),
                         1.0f / static_cast<float>(group->size()),
                         &backend_for(buckets[i].flat.device())};
      std::vector<Tensor> touched = all_reduced(i);
      std::swap(touched[0], touched[1]);  // the reduced tensor first
      dispatch(std::make_shared<AllReduceStart>(
                   group, ReduceOp::kSum, slot, [c] { c.before(); }, [c] { c.after(); }),
               std::move(touched));
    }
  }

  void on_grad(int64_t param, const Tensor& g) {
    if (sharded()) place(param, g);
    if (!communicate || ready[param]) return;
    ready[param] = 1;
    --pending[bucket_of[param]];
    if (options.overlap) launch_ready();
    if (sharded()) release_completed();
  }
};

DistributedDataParallel::DistributedDataParallel(nn::Module& model,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 const DDPOptions& options,
                                                 const std::vector<std::vector<Tensor>>& layout)
    : group_(std::move(group)), state_(std::make_shared<State>()) {
  if (options.bucket_mb <= 0 || options.first_bucket_mb <= 0)
    throw std::invalid_argument("DDP: bucket sizes must be positive");
  State& s = *state_;
  s.group = group_;
  s.options = options;
  std::vector<std::pair<std::string, Tensor>> params;
  for (auto& [name, p] : model.named_parameters())
    if (p.requires_grad()) params.emplace_back(name, p);
  // A working copy whose master is elsewhere (train.offload_master) has an fp32 gradient too.
  for (auto& [name, p] : params)
    if ((p.dtype() != DType::kF32 && !p.impl()->master_elsewhere) || !p.is_contiguous())
      throw std::invalid_argument("DDP: parameter " + name + " is not contiguous fp32");

  // The same weights on every rank: rank 0's.
  if (group_->size() > 1 && options.broadcast) {
    std::vector<std::shared_ptr<Work>> works;
    for (auto& [name, p] : params) works.push_back(group_->broadcast(p, 0));
    for (auto& w : works) w->wait();
  }

  // Buckets in reverse registration order: the first small, then bucket_mb each.
  const int64_t n = static_cast<int64_t>(params.size());
  s.bucket_of.assign(static_cast<size_t>(n), -1);
  s.offset.assign(static_cast<size_t>(n), 0);
  s.names.resize(static_cast<size_t>(n));
  s.params.resize(static_cast<size_t>(n));
  std::vector<std::vector<int64_t>> members;
  if (!layout.empty()) {  // the caller's buckets
    std::map<const TensorImpl*, int64_t> index;
    for (int64_t i = 0; i < n; ++i) index.emplace(params[i].second.impl(), i);
    int64_t placed = 0;
    for (const auto& bucket : layout) {
      members.emplace_back();
      for (const Tensor& p : bucket) {
        auto it = index.find(p.impl());
        if (it == index.end())
          throw std::invalid_argument(
              "DDP: a bucket holds a tensor that is not a trainable parameter of the model, or "
              "holds one twice");
        members.back().push_back(it->second);
        index.erase(it);
        ++placed;
      }
    }
    if (placed != n)
      throw std::invalid_argument(fmt::format(
          "DDP: the buckets hold {} of the model's {} trainable parameters", placed, n));
  }
  int64_t filled = 0;
  for (int64_t i = n - 1; layout.empty() && i >= 0; --i) {
    const int64_t bytes = params[i].second.numel() * 4;
    const double cap_mb = members.size() <= 1 ? options.first_bucket_mb : options.bucket_mb;
    if (members.empty() ||
        (filled > 0 && static_cast<double>(filled + bytes) > cap_mb * (1 << 20))) {
      members.emplace_back();
      filled = 0;
    }
    members.back().push_back(i);
    filled += bytes;
  }
  const int64_t world = group_->size();
  for (const auto& m : members) {
    int64_t numel = 0;
    for (int64_t i : m) numel += params[i].second.numel();
    const int64_t padded = (numel + world - 1) / world * world;
    Bucket b{[&] {
               const MemoryUseScope gradients(MemoryUse::kGradients);
               return options.sharded ? Tensor() : zeros({padded});
             }(),
             numel,
             {},
             {}};
    int64_t offset = 0;
    for (int64_t i : m) {
      s.offset[i] = offset;
      offset += params[i].second.numel();
      b.names.push_back(params[i].first);
      b.params.push_back(params[i].second);
      s.bucket_of[i] = static_cast<int64_t>(s.buckets.size());
      s.names[i] = params[i].first;
      s.params[i] = params[i].second;
    }
    s.padded.push_back(padded);
    if (options.compression != Compression::kNone) {
      const MemoryUseScope comm(MemoryUse::kComm);
      // Sharded: wire copies only while a bucket's reduce-scatter is in flight.
      s.wire.push_back(options.sharded ? Tensor()
                                       : zeros({padded}, options.compression == Compression::kBf16
                                                             ? DType::kBF16
                                                             : DType::kF16));
      if (options.error_feedback) s.residual.push_back(zeros({padded}));
    }
    s.buckets.push_back(std::move(b));
  }
  s.members = members;
  for (size_t b = 0; b < s.buckets.size() && !options.sharded; ++b)
    for (int64_t i : members[b]) s.allocate_view(i);
  s.ready.assign(static_cast<size_t>(n), 0);
  s.reset_for_backward();

  // Grad-ready hooks; they hold the state weakly, so a hook outliving this reducer does nothing.
  std::weak_ptr<State> weak = state_;
  for (int64_t i = 0; i < n; ++i) {
    params[i].second.register_hook([weak, i](const Tensor& g) {
      if (auto st = weak.lock()) st->on_grad(i, g);
    });
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  // Collectives still queued read bucket memory: let them finish before it goes.
  for (auto& w : state_->works) {
    try {
      if (w->work) w->work->wait();
    } catch (const std::exception&) {
    }
  }
}

void DistributedDataParallel::prepare_backward(bool sync) {
  State& s = *state_;
  if (s.options.sharded && !s.sharded())
    throw std::logic_error("DDP: built for sharded gradients, and shard_gradients was not called");
  if (s.open) complete_backward();  // the previous micro-batch's reduce-scatters
  s.sync = sync;
  s.communicate = sync || (s.sharded() && s.every_micro_batch);
  s.open = s.communicate;
  if (s.communicate) s.reset_for_backward();
}

void DistributedDataParallel::finish_backward() {
  State& s = *state_;
  if (!s.communicate) return;  // no_sync: nothing went out
  complete_backward();
  s.sync = s.communicate = true;
}

void DistributedDataParallel::complete_backward() {
  State& s = *state_;
  s.open = false;
  std::vector<std::string> missing;
  for (size_t i = 0; i < s.ready.size(); ++i)
    if (!s.ready[i]) missing.push_back(s.names[i]);
  if (!missing.empty()) {
    if (!s.options.find_unused) {
      std::string list;
      for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
      if (missing.size() > 8) list += fmt::format(" and {} more", missing.size() - 8);
      throw std::runtime_error(fmt::format(
          "DDP: parameter{} {} received no gradient in this backward; every rank must use every "
          "parameter, or set dist.find_unused = true",
          missing.size() > 1 ? "s" : "", list));
    }
    for (size_t i = 0; i < s.ready.size(); ++i)
      if (!s.ready[i]) {
        s.ready[i] = 1;
        --s.pending[s.bucket_of[i]];
      }
  }
  s.launch_ready();  // overlap off: all of them; on: whatever the hooks left
  for (size_t b = 0; b < s.works.size(); ++b)
    if (s.sharded())
      s.finish_bucket(b);
    else
      collective_wait(s.works[b], s.all_reduced(b));
  s.works.clear();
  s.done.clear();
  s.accumulating = s.sharded() && !s.sync;
}

void DistributedDataParallel::restore_grad_views() {
  State& s = *state_;
  if (s.sharded()) return;
  for (size_t i = 0; i < s.params.size(); ++i) {
    Tensor& p = s.params[i];
    const Tensor& flat = s.buckets[static_cast<size_t>(s.bucket_of[i])].flat;
    const Tensor cur = p.grad();
    if (cur.defined() && cur.has_storage() && cur.storage() == flat.storage() &&
        cur.offset() == s.offset[i] && cur.shape() == p.shape())
      continue;
    s.allocate_view(static_cast<int64_t>(i));
    if (cur.defined())
      p.grad().copy_(cur);
    else
      fill_(p.grad(), 0.0f);
  }
}

void DistributedDataParallel::zero_grad() {
  // A primitive, so a captured step zeroes its buckets on every replay.
  for (Bucket& b : state_->buckets)
    if (b.flat.defined()) dispatch(std::make_shared<ZeroInPlace>(), {b.flat});
}

std::vector<std::vector<Tensor>> DistributedDataParallel::bucket_params() const {
  std::vector<std::vector<Tensor>> out;
  for (const Bucket& b : state_->buckets) out.push_back(b.params);
  return out;
}

void DistributedDataParallel::shard_gradients(std::vector<Tensor> shards, bool every_micro_batch) {
  State& s = *state_;
  if (shards.size() != s.buckets.size())
    throw std::invalid_argument(fmt::format("DDP::shard_gradients: {} shards for {} buckets",
                                            shards.size(), s.buckets.size()));
  for (size_t b = 0; b < shards.size(); ++b)
    if (shards[b].dtype() != DType::kF32 || !shards[b].is_contiguous() ||
        shards[b].numel() * group_->size() != s.padded[b])
      throw std::invalid_argument(
          fmt::format("DDP::shard_gradients: shard {} must be contiguous fp32 of {} elements", b,
                      s.padded[b] / group_->size()));
  s.shards = std::move(shards);
  s.every_micro_batch = every_micro_batch;
  s.temp.assign(s.shards.size(), Tensor());
  s.wire_in.assign(s.shards.size(), Tensor());
  s.wire_out.assign(s.shards.size(), Tensor());
  // From now on the buckets exist only while a backward fills them.
  for (Bucket& b : s.buckets) {
    for (Tensor& p : b.params) p.set_grad(Tensor());
    b.flat = Tensor();
  }
}

const std::vector<DistributedDataParallel::Bucket>& DistributedDataParallel::buckets() const {
  return state_->buckets;
}

int64_t DistributedDataParallel::bytes_per_sync() const {
  int64_t n = 0;
  for (int64_t p : state_->padded) n += p * 4;
  return state_->options.compression == Compression::kNone ? n : n / 2;
}

}  // namespace kuai::dist
