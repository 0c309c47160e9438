// ZeRO stage 1 (Rajbhandari et al., 2020; PyTorch's ZeroRedundancyOptimizer): AdamW whose
// state is *sharded* across the ranks, not offloaded. The parameters, taken in the optimizer's
// group order, form one flat index of N elements; rank r owns elements [r S, (r + 1) S) with
// S = ceil(N / world) and keeps Adam's moments for those alone (2 S floats instead of 2 N). A step
// updates the owned elements from the averaged gradients (DDP's all-reduce), then all_gather
// brings every rank's updated elements to every rank, 16 MiB per rank at a time. AdamW is
// elementwise, so the parameters are the same bit for bit as unsharded AdamW's.
#pragma once

#include <memory>
#include <vector>

#include "kuai/dist/process_group.h"
#include "kuai/optim/adamw.h"

namespace kuai::dist {

class ZeroAdamW : public optim::Optimizer {
 public:
  // gather_chunk: elements per rank of each all_gather of the updated shards (a bound on its
  // buffers: 16 MiB of fp32 by default).
  ZeroAdamW(std::vector<optim::ParamGroup> groups, const optim::AdamWOptions& options,
            std::shared_ptr<ProcessGroup> group, int64_t gather_chunk = int64_t{1} << 22);
  using Optimizer::step;
  void step(float grad_scale = 1.0f) override;

  int64_t num_elements() const { return total_; }  // N
  int64_t shard_size() const { return shard_; }    // S
  // Bytes of optimizer state this rank holds (the moments of its shard).
  int64_t state_bytes() const { return 2 * shard_ * static_cast<int64_t>(sizeof(float)); }

 private:
  // The part of one parameter inside one rank's shard.
  struct Segment {
    size_t group, param;
    int64_t begin, length;  // elements of the parameter
    int64_t shard_offset;   // where they sit in that rank's shard
  };
  std::vector<Segment> segments_of(int rank) const;
  // Elements [begin, begin + length) of `rank`'s shard between `buf` and the parameters.
  void copy_shard_range(int rank, int64_t begin, int64_t length, float* buf, bool to_params);

  optim::AdamWOptions opt_;
  std::shared_ptr<ProcessGroup> group_;
  int64_t total_ = 0, shard_ = 0, gather_chunk_;
  std::vector<Segment> mine_;
  Tensor m_, v_;  // (S) each
};

}  // namespace kuai::dist
