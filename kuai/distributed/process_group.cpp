// Work handles, the single-process group and the choice of group (see process_group.h). The MPI
// group lives in mpi_process_group.cpp.
#include "kuai/distributed/process_group.h"

#include "kuai/core/backend.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "kuai/core/autograd.h"

namespace kuai::dist {

void Work::wait() {
  if (on_wait_) finish();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  if (!error_.empty()) throw std::runtime_error(what_ + ": " + error_);
}

bool Work::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Work::finish(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

void ProcessGroup::check_reducible(const Tensor& t, const char* op, bool low_precision) {
  if (!t.is_contiguous())
    throw std::invalid_argument(std::string(op) + ": the tensor must be contiguous");
  const bool low = t.dtype() == DType::kBF16 || t.dtype() == DType::kF16;
  if (t.dtype() != DType::kF32 && !(low_precision && low))
    throw std::invalid_argument(std::string(op) + ": cannot reduce " +
                                std::string(dtype_name(t.dtype())) + " tensors");
}

namespace {

std::shared_ptr<Work> done(const char* what) {
  auto w = std::make_shared<Work>(what);
  w->finish();
  return w;
}

// World size 1: a reduction over one rank is the identity.
class SingleProcessGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp, std::function<void()> before,
                                   std::function<void()> after) override {
    check_reducible(t, "all_reduce", true);
    record_launch(Collective::kAllReduce, t.nbytes(), t.nbytes());
    if (before) before();
    if (after) after();
    return done("all_reduce");
  }
  std::shared_ptr<Work> reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp,
                                       std::function<void()> before,
                                       std::function<void()> after) override {
    check_reducible(in, "reduce_scatter", true);
    check_reducible(out, "reduce_scatter", true);
    if (in.numel() != out.numel() || in.dtype() != out.dtype())
      throw std::invalid_argument(
          "reduce_scatter: in must hold size() * out.numel() elements of out's dtype");
    record_launch(Collective::kReduceScatter, in.nbytes(), out.nbytes());
    if (before) before();
    backend_for(out.device())
        .copy_within(out.device_ptr(), in.device_ptr(), static_cast<size_t>(in.nbytes()));
    if (after) after();
    return done("reduce_scatter");
  }
  std::shared_ptr<Work> all_gather(const Tensor& in, const Tensor& out) override {
    if (in.numel() != out.numel() || in.dtype() != out.dtype() || !in.is_contiguous() ||
        !out.is_contiguous())
      throw std::invalid_argument(
          "all_gather: in and out must be contiguous, of one dtype, out holding size() * "
          "in.numel() elements");
    record_launch(Collective::kAllGather, in.nbytes(), out.nbytes());
    backend_for(out.device())
        .copy_within(out.device_ptr(), in.device_ptr(), static_cast<size_t>(in.nbytes()));
    return done("all_gather");
  }
  std::shared_ptr<Work> broadcast(const Tensor& t, int root) override {
    if (root != 0) throw std::invalid_argument("broadcast: root out of range");
    record_launch(Collective::kBroadcast, t.nbytes(), 0);
    return done("broadcast");
  }
  void barrier() override { record_launch(Collective::kBarrier, 0, 0); }
};

class RecordingProcessGroup final : public ProcessGroup {
 public:
  RecordingProcessGroup(int world, int rank, std::function<void(const CollectiveRecord&)> record)
      : world_(world), rank_(rank), record_(std::move(record)) {
    if (world < 1 || rank < 0 || rank >= world)
      throw std::invalid_argument("recording_process_group: rank out of range");
  }
  int rank() const override { return rank_; }
  int size() const override { return world_; }
  std::string backend() const override { return "recording"; }
  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp, std::function<void()>,
                                   std::function<void()>) override {
    check_reducible(t, "all_reduce", true);
    return note(Collective::kAllReduce, "all_reduce", t, t.nbytes(), t.nbytes());
  }
  std::shared_ptr<Work> reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp,
                                       std::function<void()>, std::function<void()>) override {
    check_reducible(in, "reduce_scatter", true);
    check_reducible(out, "reduce_scatter", true);
    if (in.numel() != out.numel() * world_ || in.dtype() != out.dtype())
      throw std::invalid_argument(
          "reduce_scatter: in must hold size() * out.numel() elements of out's dtype");
    return note(Collective::kReduceScatter, "reduce_scatter", in, in.nbytes(), out.nbytes());
  }
  std::shared_ptr<Work> all_gather(const Tensor& in, const Tensor& out) override {
    if (in.numel() * world_ != out.numel() || in.dtype() != out.dtype())
      throw std::invalid_argument(
          "all_gather: out must hold size() * in.numel() elements of in's dtype");
    return note(Collective::kAllGather, "all_gather", out, in.nbytes(), out.nbytes());
  }
  std::shared_ptr<Work> broadcast(const Tensor& t, int root) override {
    if (root < 0 || root >= world_) throw std::invalid_argument("broadcast: root out of range");
    return note(Collective::kBroadcast, "broadcast", t, rank_ == root ? t.nbytes() : 0,
                rank_ == root ? 0 : t.nbytes());
  }
  void barrier() override {
    record_launch(Collective::kBarrier, 0, 0);
    if (record_) record_({"barrier", 0, DType::kF32, autograd::backward_in_progress()});
  }

 private:
  std::shared_ptr<Work> note(Collective kind, const char* op, const Tensor& whole, int64_t sent,
                             int64_t received) {
    record_launch(kind, sent, received);
    if (record_)
      record_({op, whole.nbytes(), whole.dtype(), autograd::backward_in_progress(),
               whole.has_storage() ? static_cast<const void*>(whole.storage().get()) : nullptr});
    // Complete when waited for: a trace keeps a bucket as long as its collective may be in
    // flight (DDP's ZeRO buckets, released when their reduce-scatter has completed).
    return std::make_shared<Work>(op, Work::CompletesOnWait{});
  }
  int world_, rank_;
  std::function<void(const CollectiveRecord&)> record_;
};

}  // namespace

std::shared_ptr<ProcessGroup> single_process_group() {
  return std::make_shared<SingleProcessGroup>();
}

std::shared_ptr<ProcessGroup> recording_process_group(
    int world, int rank, std::function<void(const CollectiveRecord&)> record) {
  return std::make_shared<RecordingProcessGroup>(world, rank, std::move(record));
}

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

void ProcessGroup::record_launch(Collective kind, int64_t sent, int64_t received) {
  const bool in_backward = autograd::backward_in_progress();
  std::lock_guard<std::mutex> lock(stats_mu_);
  CollectiveStats& s = stats_[static_cast<int>(kind)];
  s.calls++;
  s.bytes_sent += sent;
  s.bytes_received += received;
  if (in_backward) s.bytes_sent_in_backward += sent;
}

void ProcessGroup::record_time(Collective kind, double seconds, double seconds_in_backward) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  CollectiveStats& s = stats_[static_cast<int>(kind)];
  s.seconds += seconds;
  s.seconds_in_backward += seconds_in_backward;
}

ProcessGroup::CollectiveStats ProcessGroup::stats(Collective kind) const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_[static_cast<int>(kind)];
}

ProcessGroup::CollectiveStats ProcessGroup::total_stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  CollectiveStats t;
  for (const CollectiveStats& s : stats_) {
    t.calls += s.calls;
    t.bytes_sent += s.bytes_sent;
    t.bytes_received += s.bytes_received;
    t.bytes_sent_in_backward += s.bytes_sent_in_backward;
    t.seconds += s.seconds;
    t.seconds_in_backward += s.seconds_in_backward;
  }
  return t;
}

int launch_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"})
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') return std::atoi(v);
  return 0;
}

std::shared_ptr<ProcessGroup> default_process_group(const ProcessGroupOptions& options) {
  if (launched_by_mpi()) {
    if (!mpi_compiled())
      throw std::runtime_error(
          "launched by mpirun, but this kuai was built without MPI (install libopenmpi-dev: "
          "scripts/setup.sh, then rebuild)");
    return mpi_process_group(options);
  }
  return single_process_group();
}

}  // namespace kuai::dist
