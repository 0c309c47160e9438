// AdamW with its state offloaded to disk (technique 8's offload): the two moments live in files
// (optim/offloaded_moments.h) laid out as one flat array over the parameters, and each step
// streams them through three chunk buffers per file, reading chunk i+1 while chunk i is updated
// and chunk i-1 is written. The step is one dispatched primitive (optim/offload_update.h) whose
// evaluation runs AdamW's own update over the parameters' and gradients' elements of each chunk,
// so the parameters and moments are those of in-memory AdamW bit for bit (the kernel is
// elementwise), and a compiled step captures and replays it. What stays resident is the chunk
// buffers (3 per file, 2 files or 3 with the masters, of chunk_bytes each), counted as
// optimizer memory by the allocator.
//
// Master weights too (train.offload_master, OffloadOptions::master_params): when training in
// bf16/fp16, the parameters that only products read (nn::product_parameters: nn::Linear's) have
// their fp32 values written into a third file over the same flat layout, and are then kept in the
// compute dtype themselves: 2 bytes resident per parameter instead of 4 (their gradients stay
// fp32, TensorImpl::master_elsewhere). Autocast would have cast them to that dtype before every
// product anyway, so the forward reads the same values; the update runs on the master's chunk and
// writes its cast back into the parameter, so losses, gradients and masters are those of
// in-memory mixed precision bit for bit.
//
// The files are scratch: made empty (zero moments) when the optimizer is built, removed when it
// is destroyed. A checkpoint streams the state out and a resume back in through moments(), one
// chunk at a time; read_masters() streams the fp32 masters (a checkpoint's or an export's
// weights).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kuai/optim/adamw.h"
#include "kuai/optim/offloaded_moments.h"

namespace kuai::optim {

class OffloadedAdamW : public Optimizer {
 public:
  OffloadedAdamW(std::vector<ParamGroup> groups, const AdamWOptions& options,
                 const OffloadOptions& offload);
  ~OffloadedAdamW() override;

  // The flat layout: element e of parameter (group, index) is state element first + e. Each
  // parameter starts on a 64-byte boundary (16 floats), as a tensor of its own would.
  struct Slot {
    size_t group = 0, index = 0;
    int64_t first = 0, numel = 0;
    bool master = false;  // the parameter is a low-precision copy; its master is in the file
  };
  const std::vector<Slot>& layout() const { return slots_; }
  int64_t state_elements() const { return elements_; }
  io::ChunkStream& stream() { return moments_->stream(); }
  const io::ChunkStream& stream() const { return moments_->stream(); }
  OffloadedMoments& moments() { return *moments_; }
  std::optional<std::vector<Tensor>> capture_state() override { return {{step_, lr_tensor_}}; }

  // Whether any parameter's master is in the file (train.offload_master).
  bool has_masters() const { return masters_; }
  // Streams the fp32 masters out: fn(param, begin, count, values) for elements [begin, begin +
  // count) of each parameter whose master is offloaded, in the flat order (one read pass).
  using MasterFn =
      std::function<void(const Tensor& param, int64_t begin, int64_t count, const float* values)>;
  void read_masters(const MasterFn& fn);

 protected:
  void update(const Tensor& grad_scale, const Tensor& skip) override;

 private:
  AdamWOptions opt_;
  std::vector<Slot> slots_;
  int64_t elements_ = 0;
  std::shared_ptr<OffloadedMoments> moments_;
  bool masters_ = false;
};

// For each slot piece inside `c`: fn(slot, begin of the parameter, offset into c's arrays, count).
void for_each_slot_piece(
    const std::vector<OffloadedAdamW::Slot>& slots, const StateChunk& c, size_t& s0,
    const std::function<void(const OffloadedAdamW::Slot&, int64_t, int64_t, int64_t)>& fn);

// Which parameters of `groups` (per group, in order) have their masters offloaded under `offload`.
// Throws, naming `who`, when the working copies' dtype is not bf16 or fp16, or when a parameter
// of offload.master_params is not in the groups.
std::vector<std::vector<bool>> master_flags(const std::vector<ParamGroup>& groups,
                                            const OffloadOptions& offload, std::string_view who);

// Elements [begin, begin + n) of the working copy `p` from their fp32 masters: the Cast
// primitive's kernel, autocast's weight cast (what the update writes back and a resume restores).
void cast_master_into_(const float* master, const Tensor& p, int64_t begin, int64_t n);

// Turns the fp32 parameter `p` into its `dtype` working copy in place (the same tensor, every
// holder sees it): its values cast by the Cast primitive, its fp32 storage released, its
// gradient fp32 from now on (TensorImpl::master_elsewhere).
void keep_as_working_copy_(const Tensor& p, DType dtype);

}  // namespace kuai::optim
