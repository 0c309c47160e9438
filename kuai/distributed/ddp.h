// Distributed data parallel (technique 2), after PyTorch's DDP reducer. Every rank holds the
// whole model and computes the gradients of its own part of the batch; the gradients are
// averaged across ranks *while backward still runs*:
//   - at construction the parameters are broadcast from rank 0, and the parameters are cut into
//     buckets in reverse registration order (the order backward finishes them): the first bucket
//     small (first_bucket_mb) so communication starts early, the others bucket_mb;
//   - each parameter's .grad is a view into its bucket's flat memory, so a full bucket is
//     all-reduced in place with no packing copy;
//   - a grad-ready hook on every parameter counts the bucket down; a bucket whose last gradient
//     is final is handed to the process group's communication thread at once (in bucket order,
//     so every rank issues the same collectives in the same order), and backward goes on;
//   - finish_backward() waits for the last bucket.
// With gradient accumulation only the last micro-batch communicates (prepare_backward(false)
// before the others: PyTorch's no_sync), so the all-reduce runs once per optimizer step on the
// summed gradients (sharded, every micro-batch may reduce-scatter instead: shard_gradients).
//
// ZeRO-2 (shard_gradients): each bucket is reduce-scattered instead of all-reduced, so a rank
// receives the average of its own part of the bucket only (see distributed/zero.h for the
// partition), and the bucket's memory is held only while a backward fills it: allocated when its
// first gradient arrives, released as soon as its reduce-scatter has completed, and at the latest
// when the bucket two after it is launched (at most three in flight). The full gradients
// then never exist all at once (with overlap on); the parameters' .grad are empty between steps.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kuai/distributed/process_group.h"
#include "kuai/nn/module.h"

namespace kuai::dist {

// Gradient compression (technique 7): a cast around the all-reduce, not a feature of the
// collective. Each bucket is pre-divided by the world size (so fp16 sums cannot overflow where the
// fp32 average would not), rounded to fp16 or bf16, summed in that dtype on the wire (half the
// bytes), and widened back. With error feedback the rounding error of each element is kept
// (fp32, per bucket) and added to the next step's gradient before rounding. Sharded (ZeRO-2/3),
// the same cast goes around the reduce-scatter: the whole bucket is rounded into a wire copy,
// summed in the wire dtype, and this rank's part widened into its shard; the wire copies exist
// only while the bucket's reduce-scatter is in flight, but the residual of error feedback is a
// whole bucket's fp32 per rank, held from step to step (4 bytes per parameter that ZeRO-3 does
// not otherwise hold).
enum class Compression { kNone, kFp16, kBf16 };
const char* compression_name(Compression c);             // "none" | "fp16" | "bf16"
Compression parse_compression(const std::string& name);  // throws naming the choices

struct DDPOptions {
  double bucket_mb = 25.0;       // capacity of a bucket, MiB of fp32 gradients
  double first_bucket_mb = 1.0;  // capacity of the first one (the last parameters)
  bool overlap = true;           // all-reduce a bucket from the hooks; false: all at the end
  // A parameter that gets no gradient in a synchronising backward is an error naming it; with
  // find_unused its (zero) gradient is averaged like the others.
  bool find_unused = false;
  Compression compression = Compression::kNone;
  bool error_feedback = false;  // with compression only
  // ZeRO-2/3: no bucket memory at construction (shard_gradients follows before the first
  // backward, and a bucket exists only while a backward fills it), so the whole gradients are
  // never allocated, not even once.
  bool sharded = false;
  // Rank 0's parameters broadcast to every rank at construction; off when every rank made the
  // same ones itself (ZeRO-3's model built on meta, its shards filled from the seed).
  bool broadcast = true;
};

class DistributedDataParallel {
 public:
  // buckets: the layout, in the order backward finishes them, each parameter that requires grad
  // exactly once, in the given order inside its bucket (ZeRO-3: one bucket per unit); empty: cut
  // by size as above.
  DistributedDataParallel(nn::Module& model, std::shared_ptr<ProcessGroup> group,
                          const DDPOptions& options = {},
                          const std::vector<std::vector<Tensor>>& buckets = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Before each backward: whether it synchronises (the last micro-batch of a step) or only
  // accumulates locally (no_sync).
  void prepare_backward(bool sync);
  // After the synchronising backward: launches what the hooks have not, waits for every bucket,
  // and checks that every parameter got a gradient. The gradients are then the average over
  // ranks.
  void finish_backward();
  // Zeroes the bucket memory; the gradients stay views into it (the optimizer's zero_grad would
  // detach them).
  void zero_grad();
  // Before the first backward of a step, after an optimizer's zero_grad set the gradients to none
  // (or anything else replaced them): every gradient becomes a view into its bucket again, holding
  // what it held (zeros for none), so that PyTorch's loop (optimizer.zero_grad()) works with the
  // buckets. Gradients already in place cost nothing. Not with shard_gradients (there the hooks
  // place them).
  void restore_grad_views();

  struct Bucket {
    // fp32, the gradients of its parameters back to back, then zeros up to a multiple of the world
    // size (so that it splits into equal parts). Undefined between steps with shard_gradients.
    Tensor flat;
    int64_t numel = 0;               // elements of its parameters (without the padding)
    std::vector<std::string> names;  // its parameters, in the order they fill it
    std::vector<Tensor> params;      // the same parameters
  };
  const std::vector<Bucket>& buckets() const;
  // The buckets' parameters, bucket by bucket (the flat layout ZeRO partitions).
  std::vector<std::vector<Tensor>> bucket_params() const;
  // ZeRO-2: from now on bucket b is reduce-scattered (average) into shards[b], which holds
  // buckets()[b].flat.numel() / world elements: this rank's part. Call before the first backward.
  // every_micro_batch (ZeRO-3's default, DeepSpeed's way): with accumulation every micro-batch's
  // backward reduce-scatters too, the first of a step into the shards, the later ones added into
  // them, so no whole gradient outlives its bucket; false (FSDP's no_sync): the micro-batches
  // before the last accumulate whole gradients and only the last communicates. Sharding every
  // micro-batch sends accum_steps times the bytes and sums in another order (the ranks' sum per
  // micro-batch, then over micro-batches).
  void shard_gradients(std::vector<Tensor> shards, bool every_micro_batch = false);
  ProcessGroup& group() const { return *group_; }
  int64_t bytes_per_sync() const;  // bytes all-reduced per optimizer step (halved by compression)

 private:
  struct State;
  void complete_backward();  // waits for the open backward's collectives
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<State> state_;
};

}  // namespace kuai::dist
