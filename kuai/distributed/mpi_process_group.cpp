// The MPI process group (see process_group.h). One communication thread owns every MPI call after
// MPI_Init_thread (MPI_THREAD_SERIALIZED is all it needs). For each queued collective it
//   1. posts an "arrived at collective #seq" message to every other rank (and a receive for
//      theirs) on a communicator of its own,
//   2. starts the non-blocking collective on another duplicate of MPI_COMM_WORLD,
//   3. polls it (MPI_Test, spinning briefly, then yielding, then sleeping 50 us between polls so a
//      long all-reduce leaves the cores to backward) until it completes or its deadline passes.
// At the deadline the arrival messages that never came name the ranks that did not reach the
// collective; the rank prints that and calls MPI_Abort, which ends every rank of the run.
// A rank that dies or exits without reaching a collective (killed, crashed, _exit) makes mpirun
// send SIGTERM to the others, and SIGKILL a second later. With more than one rank the group
// catches SIGTERM: the handler only sets a flag; this thread sees it within a poll, lets the
// in-flight arrival messages land (up to 200 ms), names the ranks that never reached the
// collective it waits on, and ends the process with SIGTERM's default action. When no
// collective is queued it waits up to 600 ms for the next one (training goes on meanwhile), else
// says that it had none in flight.
// Averages are sums divided by the world size afterwards. bf16 and f16 tensors travel as 2-byte
// elements with reduction ops of our own (each pairwise sum in fp32, rounded once).
#include <fmt/format.h>

#include <cstdint>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kuai/core/allocator.h"
#include "kuai/core/autograd.h"
#include "kuai/core/backend.h"
#include "kuai/core/dtype.h"
#include "kuai/distributed/process_group.h"

#if KUAI_HAVE_MPI
#include <mpi.h>
#endif

namespace kuai::dist {

#if KUAI_HAVE_MPI

bool mpi_compiled() { return true; }

namespace {

// Set by the SIGTERM handler (async-signal-safe: a lock-free atomic store and nothing else).
std::atomic<bool> g_terminating{false};
static_assert(std::atomic<bool>::is_always_lock_free);
extern "C" void on_sigterm(int) { g_terminating.store(true, std::memory_order_relaxed); }

std::string mpi_error(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return std::string(text, static_cast<size_t>(len));
}

class MpiProcessGroup final : public ProcessGroup {
 public:
  explicit MpiProcessGroup(const ProcessGroupOptions& o) : timeout_s_(o.timeout_s) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
      if (provided < MPI_THREAD_SERIALIZED)
        throw std::runtime_error("MPI: this MPI library cannot be called from a second thread");
      owns_mpi_ = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_dup(MPI_COMM_WORLD, &arrive_comm_);
    MPI_Comm_dup(MPI_COMM_WORLD, &ping_comm_);
    MPI_Comm_set_errhandler(ping_comm_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(arrive_comm_, MPI_ERRORS_RETURN);
    MPI_Type_contiguous(2, MPI_BYTE, &half_type_);
    MPI_Type_commit(&half_type_);
    MPI_Op_create(&MpiProcessGroup::bf16_sum, /*commute=*/1, &bf16_sum_);
    MPI_Op_create(&MpiProcessGroup::f16_sum, /*commute=*/1, &f16_sum_);
    exchange_host_names();
    pongs_.assign(static_cast<size_t>(size_), 0);
    if (size_ > 1) post_ping_receive();
    if (size_ > 1) {
      struct sigaction sa = {};
      sa.sa_handler = on_sigterm;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART;
      sigaction(SIGTERM, &sa, nullptr);
      // A peer that dies leaves its sockets half-closed, and the transport's next write to one
      // would raise SIGPIPE here and end this rank by a signal before the dead one is reported:
      // the launcher would then name this rank's host, not the failed one. Ignored, the write
      // fails with EPIPE, the collective does not complete, and the watchdog or mpirun's SIGTERM
      // names the rank that is gone.
      signal(SIGPIPE, SIG_IGN);
    }
    thread_ = std::thread([this] { loop(); });
  }

  ~MpiProcessGroup() override { shutdown(); }

  // Stops the thread after the queued collectives and finalises MPI (when this group started it).
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_) return;
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&f16_sum_);
    MPI_Type_free(&half_type_);
    MPI_Comm_free(&comm_);
    MPI_Comm_free(&arrive_comm_);
    if (ping_req_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&ping_req_);
      MPI_Wait(&ping_req_, MPI_STATUS_IGNORE);
    }
    MPI_Comm_free(&ping_comm_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_mpi_ && !finalized) MPI_Finalize();
    stopped_ = true;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op, std::function<void()> before,
                                   std::function<void()> after) override {
    check_reducible(t, "all_reduce", true);
    const DType dt = t.dtype();
    const int n = count(t.numel(), "all_reduce");
    void* p = t.device_ptr();
    const MPI_Datatype type = dt == DType::kF32 ? MPI_FLOAT : half_type_;
    const MPI_Op mop = dt == DType::kF32 ? MPI_SUM : dt == DType::kBF16 ? bf16_sum_ : f16_sum_;
    return enqueue(
        fmt::format("all_reduce of {} {}", t.numel(), dtype_name(dt)),
        {Collective::kAllReduce, t.nbytes(), t.nbytes()},
        [=, this](MPI_Request* r) {
          if (before) before();
          return MPI_Iallreduce(MPI_IN_PLACE, p, n, type, mop, comm_, r);
        },
        [=, this] {
          if (op == ReduceOp::kAvg) divide(p, dt, n);
          if (after) after();
        });
  }

  std::shared_ptr<Work> reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op,
                                       std::function<void()> before,
                                       std::function<void()> after) override {
    check_reducible(in, "reduce_scatter", true);
    check_reducible(out, "reduce_scatter", true);
    if (in.numel() != out.numel() * size_ || in.dtype() != out.dtype())
      throw std::invalid_argument(fmt::format(
          "reduce_scatter: in holds {} {} elements, not size() {} x out's {} {}", in.numel(),
          dtype_name(in.dtype()), size_, out.numel(), dtype_name(out.dtype())));
    const DType dt = out.dtype();
    const int n = count(out.numel(), "reduce_scatter");
    const void* src = in.device_ptr();
    void* dst = out.device_ptr();
    const MPI_Datatype type = dt == DType::kF32 ? MPI_FLOAT : half_type_;
    const MPI_Op mop = dt == DType::kF32 ? MPI_SUM : dt == DType::kBF16 ? bf16_sum_ : f16_sum_;
    auto finish = [=, this] {
      if (op == ReduceOp::kAvg) divide(dst, dt, n);
      if (after) after();
    };
    const std::string what = fmt::format("reduce_scatter of {} {}", in.numel(), dtype_name(dt));
    const Launch launch{Collective::kReduceScatter, in.nbytes(), out.nbytes()};
    // Open MPI's reduce_scatter_block slows by an order of magnitude past a size (measured on
    // shared memory: 4.6 ms for 12 MiB, 82 ms for 16 MiB, on 2 ranks), where pieces of it keep
    // its speed. So a large one runs as pieces of kPieceBytes of input: piece i reduce-scatters
    // elements [i k, (i + 1) k) of every rank's part, gathered into a staging buffer (its size)
    // on the communication thread first. The sums are the same, element by element.
    const int64_t esize = dtype_size(dt);
    const int64_t k = std::max<int64_t>(1, kPieceBytes / (esize * size_));
    if (n <= k)
      return enqueue(
          what, launch,
          [=, this](MPI_Request* r) {
            if (before) before();
            return MPI_Ireduce_scatter_block(src, dst, n, type, mop, comm_, r);
          },
          finish);
    Tensor staging;
    {
      const MemoryUseScope comm(MemoryUse::kComm);
      staging = Tensor::empty({k * size_}, dt, out.device());
    }
    const int phases = static_cast<int>((n + k - 1) / k);
    auto phase = [=, this](int i, MPI_Request* r) {
      if (i == 0 && before) before();
      const int64_t first = i * k, len = std::min<int64_t>(k, n - first);
      auto* stage = static_cast<std::byte*>(staging.device_ptr());
      const auto* from = static_cast<const std::byte*>(src);
      for (int q = 0; q < size_; ++q)
        std::memcpy(stage + q * len * esize, from + (q * static_cast<int64_t>(n) + first) * esize,
                    static_cast<size_t>(len * esize));
      return MPI_Ireduce_scatter_block(stage, static_cast<std::byte*>(dst) + first * esize,
                                       static_cast<int>(len), type, mop, comm_, r);
    };
    return enqueue(what, launch, {}, finish, phases, phase);
  }

  std::shared_ptr<Work> all_gather(const Tensor& in, const Tensor& out) override {
    if (!in.is_contiguous() || !out.is_contiguous() || in.dtype() != out.dtype() ||
        out.numel() != in.numel() * size_)
      throw std::invalid_argument(fmt::format(
          "all_gather: in and out must be contiguous, of one dtype, out holding size() {} x "
          "in's {} elements (it holds {})",
          size_, in.numel(), out.numel()));
    const int bytes = count(in.nbytes(), "all_gather");
    const void* src = in.device_ptr();
    void* dst = out.device_ptr();
    return enqueue(fmt::format("all_gather of {} {}", in.numel(), dtype_name(in.dtype())),
                   {Collective::kAllGather, in.nbytes(), out.nbytes()}, [=, this](MPI_Request* r) {
                     return MPI_Iallgather(src, bytes, MPI_BYTE, dst, bytes, MPI_BYTE, comm_, r);
                   });
  }

  std::shared_ptr<Work> broadcast(const Tensor& t, int root) override {
    if (!t.is_contiguous()) throw std::invalid_argument("broadcast: the tensor must be contiguous");
    if (root < 0 || root >= size_)
      throw std::invalid_argument(fmt::format("broadcast: root {} of {} ranks", root, size_));
    const int bytes = count(t.nbytes(), "broadcast");
    void* p = t.device_ptr();
    return enqueue(
        fmt::format("broadcast of {} {} from rank {}", t.numel(), dtype_name(t.dtype()), root),
        {Collective::kBroadcast, rank_ == root ? t.nbytes() : 0, rank_ == root ? 0 : t.nbytes()},
        [=, this](MPI_Request* r) { return MPI_Ibcast(p, bytes, MPI_BYTE, root, comm_, r); });
  }

  void barrier() override {
    enqueue("barrier", {Collective::kBarrier, 0, 0}, [this](MPI_Request* r) {
      return MPI_Ibarrier(comm_, r);
    })->wait();
  }

 private:
  struct Task {
    std::shared_ptr<Work> work;
    std::function<int(MPI_Request*)> start;
    std::function<void()> after;
    Collective kind = Collective::kAllReduce;
    // A collective run as several MPI requests, one after the other (a large reduce-scatter in
    // pieces): phase(i, request) starts piece i, of `phases`.
    int phases = 1;
    std::function<int(int, MPI_Request*)> phase;
  };

  // MPI reduces host memory: conversions run on the CPU backend, on this thread.
  static void host_convert(const void* src, DType st, void* dst, DType dt, int64_t n) {
    static Backend& cpu = backend_for(kCPU);
    cpu.convert(src, st, dst, dt, n);
  }

  static int count(int64_t n, const char* op) {
    if (n > INT32_MAX)
      throw std::invalid_argument(fmt::format("{}: {} elements exceed MPI's int count", op, n));
    return static_cast<int>(n);
  }

  void divide(void* p, DType dt, int n) const {
    const float inv = 1.0f / static_cast<float>(size_);
    if (dt == DType::kF32) {
      float* f = static_cast<float*>(p);
      for (int i = 0; i < n; ++i) f[i] *= inv;
      return;
    }
    constexpr int kChunk = 2048;
    float f[kChunk];
    uint16_t* h = static_cast<uint16_t*>(p);
    for (int i0 = 0; i0 < n; i0 += kChunk) {
      const int m = std::min(kChunk, n - i0);
      host_convert(h + i0, dt, f, DType::kF32, m);
      for (int i = 0; i < m; ++i) f[i] *= inv;
      host_convert(f, DType::kF32, h + i0, dt, m);
    }
  }

  // MPI reduction ops on 2-byte floats: inout = round(widen(in) + widen(inout)), in chunks
  // through convert_serial's vectorised conversions.
  static void half_sum(DType t, const void* in, void* inout, int len) {
    constexpr int kChunk = 2048;
    float a[kChunk], b[kChunk];
    const uint16_t* x = static_cast<const uint16_t*>(in);
    uint16_t* y = static_cast<uint16_t*>(inout);
    for (int i0 = 0; i0 < len; i0 += kChunk) {
      const int m = std::min(kChunk, len - i0);
      host_convert(x + i0, t, a, DType::kF32, m);
      host_convert(y + i0, t, b, DType::kF32, m);
      for (int i = 0; i < m; ++i) b[i] += a[i];
      host_convert(b, DType::kF32, y + i0, t, m);
    }
  }
  static void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
    half_sum(DType::kBF16, in, inout, *len);
  }
  static void f16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
    half_sum(DType::kF16, in, inout, *len);
  }

  // A reduce-scatter of more input than this runs in pieces of it (reduce_scatter).
  static constexpr int64_t kPieceBytes = int64_t{4} << 20;
  struct Launch {
    Collective kind;
    int64_t sent, received;
  };
  std::shared_ptr<Work> enqueue(std::string what, Launch launch,
                                std::function<int(MPI_Request*)> start,
                                std::function<void()> after = {}, int phases = 1,
                                std::function<int(int, MPI_Request*)> phase = {}) {
    auto work = std::make_shared<Work>(std::move(what));
    record_launch(launch.kind, launch.sent, launch.received);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) throw std::logic_error("process group: used after shutdown");
      queue_.push_back(
          {work, std::move(start), std::move(after), launch.kind, phases, std::move(phase)});
    }
    cv_.notify_one();
    return work;
  }

  void loop() {
    using Clock = std::chrono::steady_clock;
    Clock::time_point idle_since{};  // since SIGTERM came with nothing queued
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        while (!stop_ && queue_.empty()) {
          cv_.wait_for(lock, std::chrono::milliseconds(50));
          if (!g_terminating.load(std::memory_order_relaxed) || !queue_.empty()) continue;
          if (idle_since == Clock::time_point{}) idle_since = Clock::now();
          if (Clock::now() - idle_since > std::chrono::milliseconds(600)) {
            lock.unlock();
            terminated_idle();
          }
        }
        if (queue_.empty()) return;  // stop requested and nothing left
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      run(task);
    }
  }

  void run(Task& task) {
    const int64_t seq = ++seq_;
    // 1. Arrival messages: peer p's k-th message matches our k-th receive from p.
    std::vector<int64_t> arrived(static_cast<size_t>(size_), -1);
    std::vector<MPI_Request> notes;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      notes.emplace_back();
      MPI_Irecv(&arrived[p], 1, MPI_INT64_T, p, 0, arrive_comm_, &notes.back());
      notes.emplace_back();
      MPI_Isend(&seq, 1, MPI_INT64_T, p, 0, arrive_comm_, &notes.back());
    }
    // 2. The collective.
    using Clock = std::chrono::steady_clock;
    // Its time, and the part of it while backward still runs, sampled at every poll.
    Clock::time_point last = Clock::now();
    double busy = 0, busy_in_backward = 0;
    auto tick = [&] {
      const Clock::time_point now = Clock::now();
      const double dt = std::chrono::duration<double>(now - last).count();
      busy += dt;
      if (autograd::backward_running()) busy_in_backward += dt;
      last = now;
    };
    // 3. Poll it (each of its pieces in turn) against the deadline.
    const auto t0 = Clock::now();
    const auto deadline = t0 + std::chrono::duration<double>(timeout_s_);
    int rc = MPI_SUCCESS;
    for (int i = 0; i < task.phases && rc == MPI_SUCCESS; ++i) {
      MPI_Request req = MPI_REQUEST_NULL;
      rc = task.phase ? task.phase(i, &req) : task.start(&req);
      const auto p0 = Clock::now();
      int flag = 0;
      for (int64_t polls = 0; rc == MPI_SUCCESS && !flag; ++polls) {
        rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
        serve_pings();
        tick();
        if (rc != MPI_SUCCESS || flag) break;
        if (g_terminating.load(std::memory_order_relaxed))
          terminated(task, seq, req, notes, arrived);
        if (polls < 1000) continue;
        if (Clock::now() > deadline) timed_out(task, seq, notes, arrived);
        if (Clock::now() - p0 < std::chrono::milliseconds(2))
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    if (rc != MPI_SUCCESS) {
      task.work->finish(mpi_error(rc));
      return;
    }
    MPI_Waitall(static_cast<int>(notes.size()), notes.data(), MPI_STATUSES_IGNORE);
    if (task.after) task.after();
    tick();
    record_time(task.kind, busy, busy_in_backward);
    task.work->finish();
  }

  // Every rank's host name (MPI_Get_processor_name, cut to kHostChars), gathered once at start so
  // that a failure message can say where a missing rank ran: the first thing to look at when one
  // host of many dies or drops off the network.
  static constexpr int kHostChars = 64;
  void exchange_host_names() {
    char mine[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    MPI_Get_processor_name(mine, &len);
    std::vector<char> all(static_cast<size_t>(kHostChars) * size_, '\0');
    char padded[kHostChars] = {};
    std::memcpy(padded, mine, std::min(len, kHostChars - 1));
    MPI_Allgather(padded, kHostChars, MPI_CHAR, all.data(), kHostChars, MPI_CHAR, comm_);
    hosts_.resize(size_);
    for (int p = 0; p < size_; ++p)
      hosts_[p] = std::string(all.data() + static_cast<size_t>(p) * kHostChars);
  }
  // "rank 1 (on node2)".
  std::string rank_on_host(int p) const { return fmt::format("{} (on {})", p, hosts_[p]); }

  // Liveness at a deadline. While it waits in a collective, every rank answers pings (tag kPing on
  // ping_comm_, a receive kept posted) with a pong, from its communication thread's poll loop.
  // When a collective times out after every rank arrived at it (the transfer stalled: a link cut,
  // a process stopped mid-collective), the ranks that do not answer a ping within kPingWait are
  // the ones to name. A rank that times out answers the others' pings while it waits for pongs,
  // so that ranks timing out together do not blame each other.
  static constexpr int kPing = 1, kPong = 2;
  static constexpr std::chrono::milliseconds kPingWait{1500};
  void post_ping_receive() {
    MPI_Irecv(&ping_in_, 1, MPI_INT64_T, MPI_ANY_SOURCE, kPing, ping_comm_, &ping_req_);
  }
  void serve_pings() {
    if (ping_req_ == MPI_REQUEST_NULL) return;
    int flag = 0;
    MPI_Status status;
    while (MPI_Test(&ping_req_, &flag, &status) == MPI_SUCCESS && flag) {
      const int from = status.MPI_SOURCE;
      pongs_[from] = ping_in_;
      MPI_Request r;
      MPI_Isend(&pongs_[from], 1, MPI_INT64_T, from, kPong, ping_comm_, &r);
      MPI_Request_free(&r);  // completes on its own; pongs_[from] outlives it (the group does)
      post_ping_receive();
    }
  }
  // Of the ranks that arrived at collective #seq (arrived[p] == seq: the others are named as never
  // reaching it), those that do not answer a ping within kPingWait, with their hosts ("" when all
  // do).
  std::string silent_ranks(int64_t seq, const std::vector<int64_t>& arrived,
                           std::chrono::milliseconds wait = kPingWait) {
    std::vector<int64_t> sent(static_cast<size_t>(size_), seq),
        back(static_cast<size_t>(size_), -1);
    std::vector<MPI_Request> out, in;
    std::vector<int> peer;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || arrived[p] != seq) continue;
      out.emplace_back();
      MPI_Isend(&sent[p], 1, MPI_INT64_T, p, kPing, ping_comm_, &out.back());
      in.emplace_back();
      MPI_Irecv(&back[p], 1, MPI_INT64_T, p, kPong, ping_comm_, &in.back());
      peer.push_back(p);
    }
    std::vector<int> answered(in.size(), 0);
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      serve_pings();
      bool all = true;
      for (size_t i = 0; i < in.size(); ++i) {
        if (!answered[i]) MPI_Test(&in[i], &answered[i], MPI_STATUS_IGNORE);
        all = all && answered[i];
      }
      if (all || std::chrono::steady_clock::now() > until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::string silent;
    for (size_t i = 0; i < in.size(); ++i)
      if (!answered[i]) silent += (silent.empty() ? "" : ", ") + rank_on_host(peer[i]);
    return silent;  // the requests are left: the run aborts next
  }

  // The ranks whose arrival message for collective #seq has not come ("" when all did), each with
  // its host: "1 (on node2), 3 (on node4)".
  std::string missing_ranks(int64_t seq, std::vector<MPI_Request>& notes,
                            const std::vector<int64_t>& arrived) {
    std::string missing;
    size_t k = 0;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      int got = 0;
      MPI_Test(&notes[k], &got, MPI_STATUS_IGNORE);  // the receive from p
      k += 2;
      if (!got || arrived[p] != seq) missing += (missing.empty() ? "" : ", ") + rank_on_host(p);
    }
    return missing;
  }

  // SIGTERM while waiting on collective #seq: the launcher is ending the run, almost always
  // because another rank died or exited. Name the ranks that never reached this collective.
  [[noreturn]] void terminated(const Task& task, int64_t seq, MPI_Request& req,
                               std::vector<MPI_Request>& notes,
                               const std::vector<int64_t>& arrived) {
    std::string missing;
    const auto t0 = std::chrono::steady_clock::now();
    int done = 0;
    do {  // arrival messages already on their way land within microseconds
      missing = missing_ranks(seq, notes, arrived);
      if (missing.empty()) break;
      if (!done) MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    } while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200));
    // Every rank reached it: the one that died did so inside it, and does not answer a ping.
    const std::string silent =
        missing.empty() ? silent_ranks(seq, arrived, std::chrono::milliseconds(300)) : "";
    std::fprintf(stderr,
                 "kuai: rank %d of %d (on %s): the launcher is ending the run (SIGTERM) while "
                 "this rank waits in collective #%lld (%s); %s\n",
                 rank_, size_, hosts_[rank_].c_str(), static_cast<long long>(seq),
                 task.work->what().c_str(),
                 missing.empty()
                     ? (silent.empty()
                            ? std::string("every rank reached it")
                            : fmt::format("every rank reached it; rank{} {} no longer answer{}: "
                                          "{} exited or died inside it",
                                          silent.find(',') == std::string::npos ? "" : "s", silent,
                                          silent.find(',') == std::string::npos ? "s" : "",
                                          silent.find(',') == std::string::npos ? "it" : "they"))
                           .c_str()
                     : fmt::format("rank{} {} never reached it: {} exited or died",
                                   missing.find(',') == std::string::npos ? "" : "s", missing,
                                   missing.find(',') == std::string::npos ? "it" : "they")
                           .c_str());
    die_by_sigterm();
  }

  [[noreturn]] void terminated_idle() {
    std::fprintf(stderr,
                 "kuai: rank %d of %d (on %s): the launcher is ending the run (SIGTERM); this rank "
                 "had no collective in flight (the last was #%lld)\n",
                 rank_, size_, hosts_[rank_].c_str(), static_cast<long long>(seq_));
    die_by_sigterm();
  }

  [[noreturn]] static void die_by_sigterm() {
    std::fflush(stderr);
    std::signal(SIGTERM, SIG_DFL);
    std::raise(SIGTERM);  // the whole process ends as the launcher asked
    _exit(143);
  }

  [[noreturn]] void timed_out(const Task& task, int64_t seq, std::vector<MPI_Request>& notes,
                              const std::vector<int64_t>& arrived) {
    const std::string missing = missing_ranks(seq, notes, arrived);
    const std::string silent = silent_ranks(seq, arrived);
    std::string verdict;
    if (!missing.empty()) verdict = "ranks that never reached it: " + missing;
    if (!silent.empty())
      verdict += (verdict.empty() ? "every rank reached it; " : "; ") +
                 std::string("ranks that do not answer (host unreachable or process stopped): ") +
                 silent;
    if (verdict.empty())
      verdict = "every rank reached it and answers (the transfer itself stalled)";
    std::fprintf(stderr,
                 "kuai: rank %d of %d (on %s): collective #%lld (%s) did not complete within "
                 "%.0f s; %s. Aborting the run.\n",
                 rank_, size_, hosts_[rank_].c_str(), static_cast<long long>(seq),
                 task.work->what().c_str(), timeout_s_, verdict.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::abort();  // MPI_Abort does not return
  }

  double timeout_s_;
  int rank_ = 0, size_ = 1;
  std::vector<std::string> hosts_;  // every rank's host name
  bool owns_mpi_ = false, stopped_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL, arrive_comm_ = MPI_COMM_NULL, ping_comm_ = MPI_COMM_NULL;
  MPI_Request ping_req_ = MPI_REQUEST_NULL;  // the posted receive of a ping
  int64_t ping_in_ = 0;
  std::vector<int64_t> pongs_;                  // per peer: the answer in flight
  MPI_Datatype half_type_ = MPI_DATATYPE_NULL;  // bf16 / f16 on the wire
  MPI_Op bf16_sum_ = MPI_OP_NULL, f16_sum_ = MPI_OP_NULL;
  int64_t seq_ = 0;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
};

std::mutex g_mu;
std::shared_ptr<MpiProcessGroup> g_group;

}  // namespace

std::shared_ptr<ProcessGroup> mpi_process_group(const ProcessGroupOptions& options) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_group) g_group = std::make_shared<MpiProcessGroup>(options);
  return g_group;
}

void finalize() {
  std::shared_ptr<MpiProcessGroup> g;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g = g_group;
  }
  if (g) g->shutdown();
}

void abort_run(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

#else  // no MPI in this build

bool mpi_compiled() { return false; }

std::shared_ptr<ProcessGroup> mpi_process_group(const ProcessGroupOptions&) {
  throw std::runtime_error(
      "this kuai was built without MPI (install libopenmpi-dev: scripts/setup.sh, then rebuild)");
}

void finalize() {}
void abort_run(int) {}

#endif

}  // namespace kuai::dist
