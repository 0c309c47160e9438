// Activation recomputation (see checkpoint.h). A region is a Frame: a dispatch mode that writes
// every non-view op fn dispatches onto a tape (its primitive, its inputs as the kernel saw them,
// its outputs' storages), and the saved-tensor hooks of the nodes recorded meanwhile. Tensors are
// told apart by storage: a tensor whose storage an op of the tape made is that output seen
// through a geometry (shape, strides, offset), so a view of it (a transpose, a chunk) or a
// detached handle of it (what the autograd engine and dispatch's contiguous copies hold) is
// found, and a replayed output of the same shape gives the same view of new memory.
#include "kuai/nn/checkpoint.h"

#include <fmt/format.h>

#include <atomic>
#include <memory>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "kuai/core/autograd.h"
#include "kuai/core/dispatch.h"
#include "kuai/core/primitive.h"

namespace kuai::nn {

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "?";
}

Recompute parse_recompute(const std::string& name) {
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
    if (name == recompute_name(r)) return r;
  throw std::invalid_argument("recompute: unknown policy '" + name +
                              "' (one of \"none\", \"selective\", \"full\")");
}

namespace {

struct Counters {
  std::atomic<int64_t> regions{0}, dropped{0}, kept{0}, replays{0}, replayed_ops{0};
};
Counters& counters() {
  static Counters c;
  return c;
}

// How a tensor sees the storage an op of the tape made.
struct Geometry {
  Shape shape, strides;
  int64_t offset = 0;
  DType dtype = DType::kF32;
};

Geometry geometry_of(const Tensor& t) { return {t.shape(), t.strides(), t.offset(), t.dtype()}; }

// Output `out` of tape op `op`, seen through `g`.
struct Ref {
  int op = -1;
  int out = 0;
  Geometry g;
};

Tensor view_over(const Tensor& base, const Geometry& g) {
  if (base.dtype() != g.dtype)
    throw std::logic_error(fmt::format("checkpoint: a {} view of a {} output", dtype_name(g.dtype),
                                       dtype_name(base.dtype())));
  return Tensor::view_of(base, g.shape, g.strides, g.offset);
}

class Frame;

// A saved slot of a node recorded in a region, holding a tensor an op of the region made: the
// tensor until the region exits, then either still the tensor (kept) or nothing (dropped) until
// the region's replay fills it again.
class Box final : public autograd::SavedTensor {
 public:
  Box(std::shared_ptr<Frame> f, Tensor saved, Ref r)
      : frame(std::move(f)), t(std::move(saved)), ref(std::move(r)) {}
  Tensor unpack() override;

  std::shared_ptr<Frame> frame;
  Tensor t;
  Ref ref;
  bool dropped = false;
};

struct TapeInput {
  Tensor external;  // made outside the region (parameters, the region's inputs, cached casts)
  // An external input the saved-tensor hooks around the region packed (ZeRO-3: a parameter's
  // view, whose bytes are released until its unit is gathered again): the replay unpacks it.
  std::shared_ptr<autograd::SavedTensor> packed;
  Ref ref;  // or made by an op of the tape (ref.op >= 0)
};

struct TapeOutput {
  std::weak_ptr<Storage> storage;
  Shape shape;
  DType dtype = DType::kF32;
  Tensor held;   // kept by the selective policy until the region exits
  Tensor value;  // a replay input (kept, or alive anyway) or what the replay made
};

struct TapeOp {
  std::shared_ptr<const Primitive> prim;
  std::vector<TapeInput> in;
  std::vector<TapeOutput> out;
  bool needed = false;  // the replay runs it
};

thread_local class Frame* t_region = nullptr;  // the region being recorded on this thread

class Frame final : public DispatchMode,
                    public autograd::SavedTensorHooks,
                    public std::enable_shared_from_this<Frame> {
 public:
  // outer: the saved-tensor hooks around the region (null: none). What the region did not make
  // is theirs to pack, for the region's nodes and for its replay alike.
  Frame(Recompute policy, autograd::SavedTensorHooks* outer) : policy_(policy), outer_(outer) {}

  bool intercept(const Primitive& p, std::span<const Tensor> in, std::span<Tensor> out) override {
    if (p.is_view()) return false;  // views are geometry over an op's output
    for (size_t i = 0; i < in.size(); ++i)
      if (p.mutates_input(i))
        throw std::invalid_argument(fmt::format(
            "checkpoint: {} writes its input {} in place inside a recomputed region (its replay "
            "would write it again)",
            p.name(), i));
    if (p.host_side())
      throw std::invalid_argument(fmt::format(
          "checkpoint: {} talks to other processes inside a recomputed region (its replay would "
          "do it again)",
          p.name()));
    TapeOp op;
    op.prim = p.shared_from_this();
    for (const Tensor& t : in) {
      TapeInput ti;
      if (std::optional<Ref> r = find(t)) {
        ti.ref = std::move(*r);
      } else {
        ti.external = t.detach();
        if (outer_ != nullptr) ti.packed = outer_->pack(t);
      }
      op.in.push_back(std::move(ti));
    }
    const int k = static_cast<int>(tape_.size());
    for (size_t j = 0; j < out.size(); ++j) {
      TapeOutput to;
      to.shape = out[j].shape();
      to.dtype = out[j].dtype();
      if (out[j].has_storage()) {
        to.storage = out[j].storage();
        made_[out[j].storage().get()] = {k, static_cast<int>(j)};
        if (policy_ == Recompute::kSelective && p.kept_by_selective_recompute(j))
          to.held = out[j].detach();
      }
      op.out.push_back(std::move(to));
    }
    tape_.push_back(std::move(op));
    return false;  // the op runs as usual
  }

  std::shared_ptr<autograd::SavedTensor> pack(const Tensor& saved) override {
    std::optional<Ref> r = find(saved);
    if (!r) return outer_ != nullptr ? outer_->pack(saved) : nullptr;  // made outside the region
    auto box = std::make_shared<Box>(shared_from_this(), saved.detach(), std::move(*r));
    boxes_.push_back(box);
    return box;
  }

  // At the region's exit: drop each saved tensor the region made that nothing but the saved
  // slots (and the policy) holds, and take what the replay will read.
  void finish() {
    if (tape_.empty()) return;
    counters().regions++;
    std::unordered_map<const Storage*, long> ours;  // references the region's own handles hold
    std::vector<std::shared_ptr<Box>> live;
    for (const std::weak_ptr<Box>& w : boxes_)
      if (std::shared_ptr<Box> b = w.lock()) {
        live.push_back(b);
        ours[b->t.storage().get()]++;
      }
    for (TapeOp& op : tape_)
      for (TapeOutput& o : op.out)
        if (o.held.defined()) ours[o.held.storage().get()]++;

    std::unordered_map<const Storage*, bool> counted;
    for (const std::shared_ptr<Box>& b : live) {
      const std::shared_ptr<Storage>& s = b->t.storage();
      const TapeOutput& o = output(b->ref);
      const bool elsewhere = s.use_count() > ours[s.get()];
      const bool first = !counted[s.get()];
      counted[s.get()] = true;
      if (elsewhere) continue;  // alive anyway: dropping it would free nothing
      if (o.held.defined()) {
        if (first) counters().kept += static_cast<int64_t>(s->nbytes);
        continue;
      }
      if (first) counters().dropped += static_cast<int64_t>(s->nbytes);
      b->t = Tensor();
      b->dropped = true;
      need(b->ref.op);
      dropped_.push_back(b);
    }
    // The replay's inputs: what is alive now is taken (kept), the rest is made by the replay
    // too. Latest first, so an op's producers are marked before they are visited.
    for (int k = static_cast<int>(tape_.size()) - 1; k >= 0; --k) {
      TapeOp& op = tape_[static_cast<size_t>(k)];
      if (!op.needed) continue;
      for (TapeInput& ti : op.in) {
        if (ti.ref.op < 0) continue;
        TapeOutput& src = output(ti.ref);
        if (src.value.defined()) continue;
        if (src.held.defined()) {
          src.value = src.held;
        } else if (std::shared_ptr<Storage> s = src.storage.lock()) {
          src.value = Tensor::in_storage(std::move(s), src.shape, src.dtype, 0);
        } else {
          need(ti.ref.op);
        }
      }
    }
    // Nothing else is kept: ops not replayed let go of their inputs, the policy of its outputs.
    for (TapeOp& op : tape_) {
      for (TapeOutput& o : op.out) o.held = Tensor();
      if (!op.needed) {
        op.in.clear();
        op.prim.reset();
      }
    }
    boxes_.clear();
    made_.clear();  // nothing is recorded after the region's exit
    if (dropped_.empty()) tape_.clear();
  }

  // The first unpack of a dropped slot: run the needed ops again and fill every dropped slot.
  void replay() {
    if (replayed_) return;
    replayed_ = true;
    autograd::NoGradGuard no_grad;  // the graph exists already
    counters().replays++;
    for (TapeOp& op : tape_) {
      if (!op.needed) continue;
      std::vector<Tensor> in;
      in.reserve(op.in.size());
      for (const TapeInput& ti : op.in)
        in.push_back(ti.ref.op >= 0 ? view_over(output(ti.ref).value, ti.ref.g)
                     : ti.packed    ? ti.packed->unpack()
                                    : ti.external);
      std::vector<Tensor> out = dispatch(op.prim, std::move(in));
      counters().replayed_ops++;
      for (size_t j = 0; j < out.size() && j < op.out.size(); ++j)
        if (!op.out[j].value.defined()) op.out[j].value = std::move(out[j]);
      op.in.clear();
    }
    // Every dropped slot still waiting takes its tensor; the tape lets go of the rest (replayed
    // values no slot saved).
    for (const std::weak_ptr<Box>& w : dropped_)
      if (std::shared_ptr<Box> b = w.lock()) {
        const TapeOutput& o = output(b->ref);
        if (!o.value.defined())
          throw std::logic_error(fmt::format(
              "checkpoint: the replay did not make output {} of op {}", b->ref.out, b->ref.op));
        b->t = view_over(o.value, b->ref.g);
      }
    dropped_.clear();
    tape_.clear();
  }

 private:
  std::optional<Ref> find(const Tensor& t) const {
    if (!t.defined() || !t.has_storage()) return std::nullopt;
    auto it = made_.find(t.storage().get());
    if (it == made_.end()) return std::nullopt;
    const auto [k, j] = it->second;
    // A storage freed and its address reused by memory made elsewhere is not the op's output.
    if (tape_[static_cast<size_t>(k)].out[static_cast<size_t>(j)].storage.lock() != t.storage())
      return std::nullopt;
    return Ref{k, j, geometry_of(t)};
  }

  TapeOutput& output(const Ref& r) {
    return tape_[static_cast<size_t>(r.op)].out[static_cast<size_t>(r.out)];
  }

  void need(int k) { tape_[static_cast<size_t>(k)].needed = true; }

  Recompute policy_;
  autograd::SavedTensorHooks* outer_;
  std::vector<TapeOp> tape_;
  std::unordered_map<const Storage*, std::pair<int, int>> made_;
  std::vector<std::weak_ptr<Box>> boxes_;    // every slot packed, until the region exits
  std::vector<std::weak_ptr<Box>> dropped_;  // the slots dropped, until the replay fills them
  bool replayed_ = false;
};

Tensor Box::unpack() {
  if (dropped) frame->replay();
  Tensor out = std::move(t);
  t = Tensor();
  frame.reset();
  return out;
}

}  // namespace

std::vector<Tensor> checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs,
                               Recompute policy) {
  if (policy == Recompute::kNone || !autograd::GradMode::enabled() || t_region != nullptr)
    return fn(inputs);
  auto frame = std::make_shared<Frame>(policy, autograd::saved_tensor_hooks());
  std::vector<Tensor> out;
  {
    ModeGuard mode(*frame);
    autograd::SavedTensorHooksGuard hooks(*frame);
    t_region = frame.get();
    try {
      out = fn(inputs);
    } catch (...) {
      t_region = nullptr;
      throw;
    }
    t_region = nullptr;
  }
  frame->finish();
  return out;
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                  Recompute policy) {
  return checkpoint([&fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; },
                    {input}, policy)[0];
}

RecomputeStats recompute_stats() {
  const Counters& c = counters();
  return {c.regions.load(), c.dropped.load(), c.kept.load(), c.replays.load(),
          c.replayed_ops.load()};
}

void reset_recompute_stats() {
  Counters& c = counters();
  c.regions = 0;
  c.dropped = 0;
  c.kept = 0;
  c.replays = 0;
  c.replayed_ops = 0;
}

}  // namespace kuai::nn
