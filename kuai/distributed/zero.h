// ZeRO (Rajbhandari et al., 2020; PyTorch's ZeroRedundancyOptimizer and FSDP's SHARD_GRAD_OP):
// AdamW whose state is *sharded* across the ranks, not offloaded.
//
// The partition. The parameters form flat buckets (DDP's buckets, or one bucket in the
// optimizer's group order); bucket b of n_b elements is cut into `world` equal parts of
// s_b = ceil(n_b / world) elements, and rank r owns part r of every bucket. A rank's shard is its
// parts of the buckets back to back (S = sum of s_b elements); it keeps Adam's moments for those
// alone (2 S floats instead of 2 N).
//
//   stage 1: the gradients are averaged whole (DDP's all-reduce); each rank updates its own
//            elements from them;
//   stage 2: the gradients are sharded too: DDP reduce-scatters each bucket straight into this
//            optimizer's gradient shard (gradient_shards()), so a rank receives only the average
//            of its own elements, and the full gradient buffers are released bucket by bucket.
//            The gradient norm and the fp16 overflow check then run on the shards and are
//            combined across ranks (grad_norm_tensor, found_inf_across_ranks).
//
//   stage 3: the parameters are sharded too (distributed/zero3.h): this rank's elements of every
//            parameter live in the optimizer's parameter shard (parameter_shard()), the fp32
//            master the update writes; the parameters themselves are whole only while a unit
//            runs, gathered from the shards. No all-gather follows the update.
//
// Then (stages 1 and 2) all_gather brings every rank's updated elements to every rank, 16 MiB per
// rank at a time. AdamW is elementwise, so the parameters are those of unsharded AdamW bit for
// bit.
//
// With `offload` (train.offload = disk) the moments of the shard live in files of this rank's and
// are streamed through the update in chunks (optim/offloaded_moments.h, optim/offload_update.h):
// sharding and offloading compose, each rank keeping its shard's chunk buffers only. With the
// master weights offloaded too (OffloadOptions::master_params, train.offload_master), each rank
// keeps its shard's fp32 masters in a third file and every rank holds the products' parameters as
// working copies in the compute dtype (optim/offload_adamw.h); the all-gather then brings the
// owners' updated working copies (widened to fp32 on the wire, exactly) to every rank.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kuai/distributed/process_group.h"
#include "kuai/optim/adamw.h"
#include "kuai/optim/offloaded_moments.h"

namespace kuai::dist {

class ZeroAdamW : public optim::Optimizer {
 public:
  // buckets: the flat layout, every parameter of `groups` exactly once (empty: one bucket in the
  // groups' order). stage: 1 or 2. gather_chunk: elements per rank of each all_gather of the
  // updated shards (a bound on its buffers: 16 MiB of fp32 by default).
  ZeroAdamW(std::vector<optim::ParamGroup> groups, const optim::AdamWOptions& options,
            std::shared_ptr<ProcessGroup> group, std::vector<std::vector<Tensor>> buckets = {},
            int stage = 1, int64_t gather_chunk = int64_t{1} << 22,
            std::optional<optim::OffloadOptions> offload = std::nullopt);
  int stage() const { return stage_; }
  int64_t num_elements() const { return total_; }  // N
  int64_t shard_size() const { return shard_; }    // S
  // Bytes of optimizer state this rank holds (the moments of its shard; offloaded: in files).
  int64_t state_bytes() const { return 2 * shard_ * static_cast<int64_t>(sizeof(float)); }
  // The shard's moments in files (train.offload = disk), or null (in memory).
  optim::OffloadedMoments* offloaded() const { return offloaded_.get(); }

  // Stage 3: per bucket, this rank's s_b elements of the bucket's parameters (the fp32 masters the
  // update writes; what distributed/zero3.h gathers), and the whole parameter shard (S).
  std::vector<Tensor> parameter_shards() const;
  const Tensor& parameter_shard() const { return params_; }
  // Stage 3 over parameters that have no values here (a model built on meta): the constructor
  // leaves the shard zero, and this fills it, fill(param, first element, dst) writing each of
  // this rank's segments (dst: its place in the shard, contiguous fp32) from wherever the values
  // are made (nn::GPT::initial_values).
  void fill_parameter_shard(
      const std::function<void(const Tensor& param, int64_t begin, const Tensor& dst)>& fill);
  // Elements per rank of bucket b's part (s_b), and the number of buckets.
  int64_t part(size_t b) const { return part_[b]; }
  size_t num_buckets() const { return part_.size(); }
  // Which parameters bucket b holds, in its layout's order.
  std::vector<Tensor> bucket(size_t b) const;

  // Stages 2 and 3: per bucket, the s_b elements of the gradient shard that receive this rank's
  // part of the bucket's average (hand them to DistributedDataParallel::shard_gradients), and the
  // whole shard (what the fp16 scaler unscales).
  std::vector<Tensor> gradient_shards() const;
  const Tensor& gradient_shard() const { return grad_; }
  // Stage 2: the L2 norm of the whole averaged gradient from the shards (a collective: every
  // rank's sum of squares, gathered and added in rank order, so every rank gets the same norm).
  Tensor grad_norm_tensor() const;
  // found_inf of this rank's shard, combined over the ranks (a collective): every rank skips or
  // steps alike.
  Tensor found_inf_across_ranks(const Tensor& found_inf) const;

  // The part of one parameter inside one rank's shard.
  struct Segment {
    size_t group, param;    // the parameter, as groups()[group].params[param]
    int64_t begin, length;  // elements of the parameter
    int64_t shard_offset;   // where they sit in that rank's shard
  };
  // This rank's segments, and any rank's.
  const std::vector<Segment>& segments() const { return segments_[group_->rank()]; }
  const std::vector<Segment>& segments(int rank) const {
    return segments_[static_cast<size_t>(rank)];
  }
  // Whether (group, param)'s master is in the masters file (train.offload_master).
  bool has_masters() const { return masters_; }
  // Every rank's masters to rank 0, as the ranks stream their files (a collective: every rank
  // calls it). Rank 0's fn gets (parameter, first element, count, fp32 values) for every master
  // element of every rank; the other ranks' fn is not called (it may be empty). A rank whose
  // stream fails makes every rank throw, once the rounds are done.
  using MasterFn =
      std::function<void(const Tensor& param, int64_t begin, int64_t count, const float* values)>;
  void gather_masters(const MasterFn& fn);
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }
  bool is_master(size_t group, size_t param) const { return master_of_[group][param]; }
  // The moments of this rank's shard (S elements each); filled by a checkpoint restore. Undefined
  // when offloaded.
  // Stage 3 makes them at the first update (or here), once the whole parameters the model was
  // built with are gone: the moments and the whole model are never resident together.
  Tensor& exp_avg() {
    make_moments();
    return m_;
  }
  Tensor& exp_avg_sq() {
    make_moments();
    return v_;
  }
  // The state a captured step updates (compile.h): the moments, the gradient and parameter
  // shards; with offloaded master weights the step is not captured (nullopt) and runs eagerly.
  std::optional<std::vector<Tensor>> capture_state() override;

 protected:
  void update(const Tensor& grad_scale, const Tensor& skip) override;
  void make_moments();  // zero moments, in memory, unless they are (or are offloaded)

 private:
  std::vector<Segment> segments_of(int rank) const;  // computed once, into segments_
  // Elements [begin, begin + length) of `rank`'s shard between `buf` and the parameters.
  void copy_shard_range(int rank, int64_t begin, int64_t length, const Tensor& buf,
                        int64_t buf_offset, bool to_params);

  struct Member {
    size_t group, param;
    int64_t numel;
  };
  optim::AdamWOptions opt_;
  std::shared_ptr<ProcessGroup> group_;
  int stage_;
  int64_t total_ = 0, shard_ = 0, gather_chunk_;
  std::vector<std::vector<Member>> buckets_;
  std::vector<int64_t> part_;                   // s_b per bucket
  std::vector<int64_t> part_offset_;            // where bucket b's part starts in a shard
  std::vector<std::vector<Segment>> segments_;  // per rank
  Tensor m_, v_;                                // (S) each, in memory
  std::shared_ptr<optim::OffloadedMoments> offloaded_;
  bool masters_ = false;
  std::vector<std::vector<bool>> master_of_;  // per group, per parameter
  Tensor grad_;                               // (S), stages 2 and 3
  Tensor params_;                             // (S), stage 3: this rank's fp32 masters
};

// The rounds of a gather of every rank's masters to rank 0 while the ranks stream their state
// files (ZeRO with masters offloaded): chunk i of each rank's files covers the same elements of its
// shard (the shards have one size), so round i gathers chunk i of every rank's masters. A rank
// whose stream fails calls finish(), which takes part in the remaining rounds with nothing, so no
// rank waits for it; the caller then reports the failure (a checkpoint's commit).
class MasterGather {
 public:
  explicit MasterGather(const ZeroAdamW& opt);
  // One round, a collective: this rank's masters of shard elements [first, first + count) out;
  // on rank 0 fn(param, first element, count, values) for each piece of every rank's masters.
  void round(const float* master, int64_t first, int64_t count, const ZeroAdamW::MasterFn& fn);
  void finish();  // the remaining rounds, sending nothing; a failed gather is not retried
  bool failed() const { return failed_; }  // a round's collective itself failed

 private:
  const ZeroAdamW& opt_;
  int64_t rounds_ = 0, done_ = 0, chunk_ = 0;
  bool failed_ = false;
  Tensor send_, all_;
};

}  // namespace kuai::dist
