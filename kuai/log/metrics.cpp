// The metric ring and its logger thread (see metrics.h).
#include "kuai/log/metrics.h"

#include <algorithm>

namespace kuai::log {

double LoggedStep::get(const std::string& name, double fallback) const {
  for (const auto& [k, v] : values)
    if (k == name) return v;
  return fallback;
}

bool LoggedStep::has(const std::string& name) const {
  return std::any_of(values.begin(), values.end(),
                     [&](const auto& kv) { return kv.first == name; });
}

MetricRing::MetricRing(std::vector<std::unique_ptr<MetricSink>> sinks, int64_t lag,
                       int64_t capacity)
    : sinks_(std::move(sinks)),
      lag_(std::max<int64_t>(0, lag)),
      capacity_(capacity > 0 ? capacity : std::max<int64_t>(0, lag) + 16) {
  thread_ = std::thread([this] { run(); });
}

MetricRing::~MetricRing() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (auto& s : sinks_) {
    try {
      s->flush();
    } catch (...) {  // a destructor reports nothing; flush() is where errors surface
    }
  }
}

LoggedStep MetricRing::convert(const StepMetrics& m) {
  LoggedStep s;
  s.step = m.step;
  s.wall_time = m.wall_time;
  // The one place a device value becomes a host number. On the CPU device this is a load; on an
  // accelerator it waits for the step that produced the value, which finished `lag` steps ago.
  if (m.ready) m.ready();
  for (const auto& [name, t] : m.device) s.values.emplace_back(name, t.item());
  for (const auto& kv : m.host) s.values.push_back(kv);
  return s;
}

void MetricRing::run() {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] {
    if (pending_.empty()) return false;
    const int64_t step = pending_.front().step;
    return stop_ || step <= newest_ - lag_ || step <= flush_until_;
  };
  for (;;) {
    cv_.wait(lock, [&] { return has_announce_ || ready() || (stop_ && pending_.empty()); });
    if (has_announce_) {
      LoggedStep a = std::move(announce_);
      has_announce_ = false;
      lock.unlock();
      try {
        for (auto& sink : sinks_) sink->pushed(a);
      } catch (...) {  // progress display only; write() reports real failures
      }
      lock.lock();
      continue;
    }
    if (pending_.empty()) break;  // stop_ with nothing left
    StepMetrics m = std::move(pending_.front());
    pending_.pop_front();
    done_cv_.notify_all();  // room in the ring
    lock.unlock();
    LoggedStep s;
    std::exception_ptr err;
    try {
      s = convert(m);
      m = StepMetrics{};  // release the device tensors here, off the training thread
      for (auto& sink : sinks_) sink->write(s);
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (err && !error_) error_ = err;
    if (!err) history_.push_back(std::move(s));
    ++written_;
    done_cv_.notify_all();
  }
}

void MetricRing::push(StepMetrics m) {
  std::unique_lock<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
  done_cv_.wait(lock, [&] { return static_cast<int64_t>(pending_.size()) < capacity_; });
  newest_ = std::max(newest_, m.step);
  announce_ = LoggedStep{m.step, m.wall_time, m.host};
  has_announce_ = true;
  pending_.push_back(std::move(m));
  ++pushed_;
  lock.unlock();
  cv_.notify_all();
}

void MetricRing::flush() {
  std::unique_lock<std::mutex> lock(mu_);
  flush_until_ = newest_;
  const int64_t target = pushed_;
  cv_.notify_all();
  done_cv_.wait(lock, [&] { return written_ >= target; });
  if (error_) std::rethrow_exception(error_);
  // The logger thread is idle (everything pushed is written) and the single producer is here.
  for (auto& s : sinks_) s->flush();
}

std::vector<LoggedStep> MetricRing::history() const {
  std::lock_guard<std::mutex> lock(mu_);
  return history_;
}

}  // namespace kuai::log
