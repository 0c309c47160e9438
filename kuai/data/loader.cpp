// The prefetching DataLoader: slot ring, worker threads, in-order delivery (see loader.h).
#include "kuai/data/loader.h"

#include <fmt/format.h>

#include <chrono>
#include <exception>
#include <stdexcept>

namespace kuai::data {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::nanoseconds delay_of(const LoaderOptions& opts) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double, std::milli>(opts.delay_ms));
}

}  // namespace

DataLoader::DataLoader(std::shared_ptr<const BatchSource> source, LoaderOptions opts,
                       int64_t start_index)
    : source_(std::move(source)), opts_(opts), next_index_(start_index), released_(start_index) {
  if (!source_) throw std::invalid_argument("DataLoader: no batch source");
  if (opts_.workers < 0)
    throw std::invalid_argument(fmt::format("DataLoader: workers = {} < 0", opts_.workers));
  if (opts_.prefetch_factor < 1)
    throw std::invalid_argument(
        fmt::format("DataLoader: prefetch_factor = {} < 1", opts_.prefetch_factor));
  if (!(opts_.delay_ms >= 0))
    throw std::invalid_argument(fmt::format("DataLoader: delay_ms = {} < 0", opts_.delay_ms));
  if (start_index < 0)
    throw std::invalid_argument(fmt::format("DataLoader: start index {} < 0", start_index));

  // Buffers are allocated once, here, and reused for every batch. CPU memory for now; with an
  // accelerator they would be pinned host memory so the copy to the device can be asynchronous.
  const Shape shape = {source_->batch_size(), source_->seq_len()};
  const int64_t n = opts_.workers == 0 ? 1 : int64_t{opts_.workers} * opts_.prefetch_factor;
  slots_.resize(static_cast<size_t>(n));
  for (Slot& s : slots_) {
    s.x = Tensor::empty(shape, DType::kI32);
    s.y = Tensor::empty(shape, DType::kI32);
    s.x_data = s.x.data<int32_t>();
    s.y_data = s.y.data<int32_t>();
  }
  start_workers();
}

DataLoader::~DataLoader() { stop_workers(); }

void DataLoader::start_workers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
    released_ = next_index_;
    for (Slot& s : slots_) {
      s.index = -1;
      s.state = SlotState::kFree;
      s.error.clear();
    }
  }
  const int w = opts_.workers;
  try {
    for (int k = 0; k < w; ++k) {
      // The first index >= next_index_ that is k modulo w.
      const int64_t first = next_index_ + ((k - next_index_ % w) % w + w) % w;
      threads_.emplace_back(&DataLoader::worker_main, this, k, first);
    }
  } catch (...) {
    stop_workers();  // a thread failed to start: join those that did
    throw;
  }
}

void DataLoader::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_free_.notify_all();
  cv_ready_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

void DataLoader::worker_main(int worker, int64_t first_index) {
  const int64_t n = num_slots();
  const auto delay = delay_of(opts_);
  for (int64_t i = first_index;; i += opts_.workers) {
    Slot& slot = slots_[static_cast<size_t>(i % n)];
    {
      std::unique_lock<std::mutex> lock(mu_);
      // The slot last held batch i - n; it is free once the consumer has moved past it.
      cv_free_.wait(lock, [&] { return stop_ || i < released_ + n; });
      if (stop_) return;
      slot.index = i;
      slot.state = SlotState::kFilling;
    }
    std::string error;
    try {
      source_->fill(i, slot.x_data, slot.y_data);
    } catch (const std::exception& e) {
      error = fmt::format("data worker {}: {}", worker, e.what());
    } catch (...) {
      error = fmt::format("data worker {}: unknown exception", worker);
    }
    const bool failed = !error.empty();
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!failed && delay.count() > 0) {
        // Interruptible, so that destroying a slow loader is prompt.
        cv_free_.wait_until(lock, Clock::now() + delay, [&] { return stop_; });
        if (stop_) return;
      }
      slot.state = failed ? SlotState::kFailed : SlotState::kReady;
      slot.error = std::move(error);
    }
    cv_ready_.notify_all();
    if (failed) return;  // later batches of this worker are never due: next() throws first
  }
}

Batch DataLoader::next() {
  const auto t0 = Clock::now();
  const int64_t i = next_index_;
  Slot& slot = slots_[static_cast<size_t>(i % num_slots())];
  if (opts_.workers == 0) {
    source_->fill(i, slot.x_data, slot.y_data);
    if (opts_.delay_ms > 0) std::this_thread::sleep_for(delay_of(opts_));
  } else {
    std::unique_lock<std::mutex> lock(mu_);
    if (released_ < i) {
      released_ = i;  // the batch handed out last time (i - 1) is given back
      lock.unlock();
      cv_free_.notify_all();
      lock.lock();
    }
    cv_ready_.wait(lock, [&] {
      return stop_ || (slot.index == i &&
                       (slot.state == SlotState::kReady || slot.state == SlotState::kFailed));
    });
    if (stop_)  // only after a failed restart in load_state
      throw std::runtime_error("DataLoader: the data workers are not running");
    if (slot.state == SlotState::kFailed) {
      last_wait_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      throw std::runtime_error(slot.error);
    }
  }
  last_wait_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  ++next_index_;
  return Batch{slot.x, slot.y, i};
}

void DataLoader::load_state(const LoaderState& state) {
  if (state.next_index < 0)
    throw std::invalid_argument(
        fmt::format("DataLoader: load_state: next index {} < 0", state.next_index));
  stop_workers();
  next_index_ = state.next_index;
  start_workers();
}

}  // namespace kuai::data
