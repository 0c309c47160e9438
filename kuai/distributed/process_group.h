// ProcessGroup: the collectives data-parallel training needs (all_reduce, reduce_scatter,
// all_gather, broadcast, barrier) across the ranks of a run, in the shape of PyTorch's
// c10d::ProcessGroup. Two implementations:
//   - single: world size 1, every collective completes at once (no mpirun needed);
//   - mpi: MPI_COMM_WORLD of a run launched by `mpirun -np N kuai train ...`.
//
// Collectives are asynchronous: each call queues the collective on the group's one communication
// thread and returns a Work handle at once, so a caller (the DDP reducer) can start an
// all-reduce while backward still runs. Collectives run in the order they were called, which is
// what keeps ranks matched: every rank must call the same collectives in the same order.
//
// No hang: every collective has a deadline (ProcessGroupOptions::timeout_s). A rank that waits
// past it prints which collective timed out and which ranks never arrived at it, then aborts the
// whole run (MPI_Abort): the survivors of a crashed or stuck rank end with a message.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "kuai/core/tensor.h"

namespace kuai::dist {

enum class ReduceOp { kSum, kAvg };

// The handle of one queued collective. wait() blocks until it has completed on this rank, and
// rethrows the error that ended it.
class Work {
 public:
  explicit Work(std::string what) : what_(std::move(what)) {}
  // A Work that no communication thread finishes: it completes when it is waited for (a recording
  // group's, which runs no collective: code that releases what a collective has finished with
  // as soon as is_completed() says so then keeps it as long as a real collective might).
  struct CompletesOnWait {};
  Work(std::string what, CompletesOnWait) : what_(std::move(what)), on_wait_(true) {}
  void wait();
  bool is_completed();
  const std::string& what() const { return what_; }
  // Called by the group once the collective is over (error empty on success).
  void finish(std::string error = {});

 private:
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool on_wait_ = false;
  std::string error_;
};

struct ProcessGroupOptions {
  double timeout_s = 300.0;  // per collective; then the run aborts with a message
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "single" | "mpi"

  // The tensors must be contiguous and stay alive and untouched until the Work completes.
  // Reductions take fp32, bf16 or f16 tensors (bf16/f16: each pairwise sum in fp32, rounded
  // once: the wire format of gradient compression); all_gather and broadcast any dtype.
  // `before` and `after` (optional) of a reduction run on the communication thread just before
  // the collective starts and just after it completes (the compression hooks cast there, off the
  // training thread).
  // In place: t = op over ranks of t.
  virtual std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op,
                                           std::function<void()> before = {},
                                           std::function<void()> after = {}) = 0;
  // in holds size() * n elements; out (n, in's dtype) receives this rank's part of the
  // reduction: elements [rank * n, (rank + 1) * n) of op over ranks of in.
  virtual std::shared_ptr<Work> reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op,
                                               std::function<void()> before = {},
                                               std::function<void()> after = {}) = 0;
  // in (n) of every rank into out (size() * n), rank r's at [r * n, (r + 1) * n).
  virtual std::shared_ptr<Work> all_gather(const Tensor& in, const Tensor& out) = 0;
  // t of rank `root` into t of every rank.
  virtual std::shared_ptr<Work> broadcast(const Tensor& t, int root) = 0;
  // Returns when every rank has called it (within the timeout).
  virtual void barrier() = 0;

  // What this rank has launched so far, per kind of collective, counted when each is called:
  // calls, payload bytes it sends and receives (all_reduce: its tensor both ways; reduce_scatter:
  // in out, out back; all_gather: in out, out back; broadcast: the root sends, the others
  // receive), and the bytes sent by collectives launched while backward was still running on the
  // calling thread (DDP's overlap). Payload in the dtype handed over, so gradient compression
  // shows as the halved payload it is; the wire protocol's own traffic is MPI's.
  struct CollectiveStats {
    int64_t calls = 0;
    int64_t bytes_sent = 0;
    int64_t bytes_received = 0;
    int64_t bytes_sent_in_backward = 0;
    // Time the communication thread spent on these collectives (from its start call to their
    // completion and hooks), and the part of it while some thread was still in backward: the
    // overlap in time, beside the launch share above. Zero for groups without a thread.
    double seconds = 0;
    double seconds_in_backward = 0;
  };
  enum class Collective { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kBarrier };
  static constexpr int kNumCollectives = 5;
  CollectiveStats stats(Collective kind) const;
  CollectiveStats total_stats() const;  // all kinds together
  // Bytes this rank has handed to collectives so far: total_stats().bytes_sent.
  int64_t bytes_sent() const { return total_stats().bytes_sent; }

 protected:
  // Called by the communication thread as a collective completes.
  void record_time(Collective kind, double seconds, double seconds_in_backward);
  // Called by each collective on the caller's thread as it is launched.
  void record_launch(Collective kind, int64_t sent, int64_t received);
  // Throws std::invalid_argument unless t is contiguous and fp32 (or bf16/f16 where
  // low_precision is allowed): the tensors the reductions accept.
  static void check_reducible(const Tensor& t, const char* op, bool low_precision);

 private:
  mutable std::mutex stats_mu_;
  CollectiveStats stats_[kNumCollectives];
};

std::shared_ptr<ProcessGroup> single_process_group();

// One collective as a recording group saw it launched.
struct CollectiveRecord {
  std::string op;     // "all_reduce" | "reduce_scatter" | "all_gather" | "broadcast" | "barrier"
  int64_t bytes = 0;  // the whole buffer (all_reduce: t; reduce_scatter: in; all_gather: out)
  DType dtype = DType::kF32;
  bool in_backward = false;  // launched while backward was running on the launching thread
  // The storage the collective fills (all_gather: out; others: their tensor), so that the
  // planner can find the first op that reads it (where the step waits for it). Identity only.
  const void* buffer = nullptr;
};
// `world` ranks seen from rank `rank`, whose collectives are recorded, not sent: `kuai plan` runs
// a step on meta tensors through it. Each collective completes at once and leaves its tensors as
// they are; compression hooks do not run (they read bytes a meta tensor does not have).
// `record` is called on the launching thread.
std::shared_ptr<ProcessGroup> recording_process_group(
    int world, int rank, std::function<void(const CollectiveRecord&)> record);

// Whether this build has MPI, and whether this process was started by mpirun (or another MPI
// launcher: OMPI_COMM_WORLD_SIZE or PMI_SIZE is set).
bool mpi_compiled();
bool launched_by_mpi();
// This process's rank as the launcher announces it (OMPI_COMM_WORLD_RANK or PMI_RANK), readable
// before MPI is initialised; 0 when not launched by MPI.
int launch_rank();

// MPI_COMM_WORLD, MPI initialised on first use (one group per process; later calls return it).
// Throws when the build has no MPI.
std::shared_ptr<ProcessGroup> mpi_process_group(const ProcessGroupOptions& options = {});

// What the trainer uses: MPI when launched by mpirun, else the single-process group.
std::shared_ptr<ProcessGroup> default_process_group(const ProcessGroupOptions& options = {});

// End of a run. finalize(): the queued collectives complete, the communication thread stops and
// MPI is finalised (a no-op without MPI); call it once every rank is done. abort_run(code): after
// an error on one rank, ends every rank of the run now (MPI_Abort) instead of leaving the others
// waiting in a collective; a no-op when MPI is not running.
void finalize();
void abort_run(int code);

}  // namespace kuai::dist
