// Metrics without per-step host synchronisation (technique 10). The training loop pushes each
// step's device scalars (loss, gradient norm, ...) into a bounded ring without reading them; a
// logger thread turns them into numbers `lag` steps later, when the device has long finished
// them, and hands the numbers to the sinks (console, JSONL, TensorBoard). Reading a device value
// on the host waits for the device whatever the call is named, so the step loop never does it:
// the only conversion of a device value to a host number is here, on the logger thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kuai/core/tensor.h"

namespace kuai::log {

// One step as the training loop pushes it.
struct StepMetrics {
  int64_t step = 0;        // 1-based optimizer step
  double wall_time = 0.0;  // seconds since the epoch, when the step ended
  // One-element device tensors, detached from autograd; read later by the logger thread.
  std::vector<std::pair<std::string, Tensor>> device;
  // Values the host already knows (learning rate, step time, data wait, ...).
  std::vector<std::pair<std::string, double>> host;
  // When set, called on the logger thread before the device values are read: it waits for
  // whatever still writes them (the all-reduce that averages the loss over ranks).
  std::function<void()> ready;
};

// The same step with every value a number: what sinks receive.
struct LoggedStep {
  int64_t step = 0;
  double wall_time = 0.0;
  std::vector<std::pair<std::string, double>> values;  // device values first, then host ones

  // The value named `name`, or `fallback` when the step has none.
  double get(const std::string& name, double fallback = 0.0) const;
  bool has(const std::string& name) const;
};

class MetricSink {
 public:
  virtual ~MetricSink() = default;
  virtual void write(const LoggedStep& s) = 0;
  // A step was just pushed: its host values only (a progress bar can move before the step's
  // device values are read). Called on the logger thread, possibly skipping steps.
  virtual void pushed(const LoggedStep& host_only) { (void)host_only; }
  virtual void flush() {}
};

class MetricRing {
 public:
  // `lag`: a step is converted once a step `lag` later has been pushed (or at flush).
  // `capacity`: pushes block while this many steps wait for conversion (bounded memory).
  MetricRing(std::vector<std::unique_ptr<MetricSink>> sinks, int64_t lag, int64_t capacity = 0);
  ~MetricRing();  // flushes; never throws
  MetricRing(const MetricRing&) = delete;
  MetricRing& operator=(const MetricRing&) = delete;

  // Never reads a device value. Rethrows a sink's earlier failure (disk full, ...).
  void push(StepMetrics m);
  // Converts and writes everything pushed so far, flushes the sinks; rethrows a sink's failure.
  void flush();
  // Every step written so far, in order (flush first for all of them).
  std::vector<LoggedStep> history() const;

 private:
  void run();
  static LoggedStep convert(const StepMetrics& m);

  std::vector<std::unique_ptr<MetricSink>> sinks_;
  const int64_t lag_;
  const int64_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;       // logger: work or stop
  std::condition_variable done_cv_;  // producers: room, or flush finished
  std::deque<StepMetrics> pending_;
  LoggedStep announce_;  // host values of the newest push, not yet announced
  bool has_announce_ = false;
  int64_t newest_ = 0;       // newest pushed step
  int64_t flush_until_ = 0;  // convert every pending step <= this regardless of lag
  int64_t written_ = 0;      // pushes fully written
  int64_t pushed_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<LoggedStep> history_;
  std::thread thread_;
};

}  // namespace kuai::log
