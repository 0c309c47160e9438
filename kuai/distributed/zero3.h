// ZeRO-3 (Rajbhandari et al., 2020; PyTorch's FSDP with FULL_SHARD): the parameters are sharded
// across the ranks too, so no rank ever holds the whole model.
//
// The model is cut into units (nn/units.h: a GPT's embedding, each block, its head). ZeroAdamW at
// stage 3 keeps this rank's part of every unit's flat parameters (its fp32 masters), gradients
// and moments: 1/N of each. Every parameter is a view into its unit's flat buffer, whose bytes
// exist only while the unit is whole (core/tensor.h: Storage::release and materialize, as FSDP
// resizes a storage to 0 and back):
//   - forward: before a unit runs, its buffer is all-gathered from the ranks' shards (the
//     model's UnitHooks); after it, the bytes are released (Zero3Options::reshard_after_forward;
//     off, they stay for backward: ZeRO-2's memory for the parameters, one gather per step). The
//     last unit stays whole: it is the first one backward needs.
//   - the tensors a unit's ops save for backward are its parameters' views: they are packed
//     (autograd's saved-tensor hooks) into handles that keep the storage, not the bytes. When the
//     first node of the unit's backward unpacks one, the unit is gathered again; once none of a
//     unit's saved tensors is left to unpack, its bytes are released at the next unit's use, or
//     when backward ends.
//   - the gradients: DDP's reducer with one bucket per unit (in backward order), reduce-scattered
//     into the gradient shard on the communication thread as soon as the unit's backward has
//     produced them all, while the next unit's backward runs (ZeRO-2's path).
//   - prefetch: as a unit starts (forward) or is first used (backward), the gathers of the next
//     Zero3Options::prefetch units in that direction are issued on the communication thread, so
//     they overlap the unit's compute.
// Whole at once, at most: the unit running, the `prefetch` units after it, and the units its
// forward reads besides its own (a tied head's embedding); in backward one more, the unit just
// finished, until the next unit's first use releases it; and the last unit between forward and
// backward. stats().max_whole counts it as it happens.
//
// The update writes only the shard (ZeroAdamW stage 3), so nothing is gathered after a step: the
// next forward gathers what it needs. Reading a parameter outside its unit's forward or backward
// is an error naming the tensor (its bytes are released), never a read of freed memory; a Whole
// guard gathers units for the code that must read them there, and for_each_unit_values gives an
// export the fp32 values unit by unit.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kuai/core/autograd.h"
#include "kuai/distributed/zero.h"
#include "kuai/nn/units.h"

namespace kuai::dist {

struct Zero3Options {
  bool reshard_after_forward = true;  // dist.reshard_after_forward
  int prefetch = 1;                   // dist.prefetch: units gathered ahead (0: on demand)
  // dist.gather_dtype: bf16 / f16 gathers the parameters given as `low` (the products' weights,
  // which autocast casts to the compute dtype before every use anyway) in it: half the bytes sent
  // and held whole, the forward and backward reading the values autocast would have made; the
  // fp32 shard stays the master. The others (norms, embeddings) are gathered in fp32.
  DType gather_dtype = DType::kF32;
};

class ShardedParameters final : public nn::UnitHooks, public autograd::SavedTensorHooks {
 public:
  // The bucket layout DDP and ZeroAdamW are built on: the units in backward order (the last unit
  // first), each unit's parameters in its own order; with `low` parameters, a unit's in `low`
  // make a bucket of their own (gathered in the low dtype) ahead of its others.
  static std::vector<std::vector<Tensor>> bucket_layout(const std::vector<nn::ModelUnit>& units,
                                                        const std::vector<Tensor>& low = {});

  // units: the model's, in forward order; opt: stage 3, built on bucket_layout(units, low)
  // (checked). The parameters become views into their units' buffers, released until they are
  // gathered; those in `low` (options.gather_dtype not fp32) are kept in the gather dtype.
  ShardedParameters(std::vector<nn::ModelUnit> units, ZeroAdamW& opt,
                    const Zero3Options& options = {}, const std::vector<Tensor>& low = {});
  ~ShardedParameters() override;
  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  // nn::UnitHooks: called by the model around each unit's forward.
  void before(size_t unit) override;
  void after(size_t unit) override;
  // autograd::SavedTensorHooks: a saved view of a unit's parameters, kept without its bytes.
  std::shared_ptr<autograd::SavedTensor> pack(const Tensor& saved) override;

  // Units gathered whole while the guard lives, for reading outside forward and backward (a
  // collective: every rank makes the same guards in the same order).
  class Whole {
   public:
    Whole(ShardedParameters& owner, std::vector<size_t> units);
    ~Whole();
    Whole(const Whole&) = delete;
    Whole& operator=(const Whole&) = delete;

   private:
    ShardedParameters& owner_;
    std::vector<size_t> units_;
  };

  // Every parameter's fp32 values (the masters: a parameter gathered in a low dtype has them
  // gathered from the shards in fp32), unit by unit, fn(param, its numel() values) called while
  // they are held: at most one unit whole at a time besides what is whole already. A collective.
  void for_each_unit_values(
      const std::function<void(const Tensor& param, const float* values)>& fn);

  size_t num_units() const;
  const std::string& unit_name(size_t unit) const;
  const std::vector<Tensor>& unit_params(size_t unit) const;
  int64_t unit_bytes(size_t unit) const;  // of its gathered fp32 buffer (padded to the ranks)
  bool is_whole(size_t unit) const;       // gathered (or being gathered)
  const Zero3Options& options() const;

  struct Stats {
    int64_t gathers = 0;         // all-gathers issued
    int64_t gathered_bytes = 0;  // bytes they brought in (whole buffers)
    int64_t gathers_in_backward = 0;
    size_t max_whole = 0;         // most units whole at once
    int64_t max_whole_bytes = 0;  // and their bytes
    // Time the training thread spent waiting for gathers to complete: what prefetch did not
    // hide behind the units before (forward and backward).
    double wait_seconds = 0;
  };
  Stats stats() const;
  void reset_stats();

  struct State;  // the implementation's (shared with the saved tensors it packs)

 private:
  std::shared_ptr<State> state_;
};

}  // namespace kuai::dist
