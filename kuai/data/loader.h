// The prefetching DataLoader (technique 5). Worker threads fill batches from a BatchSource into
// a fixed ring of reusable slot buffers while the training step runs, so compute does not wait
// on data; batches are delivered in index order whatever the worker timing, and the position
// (the next index) is all a checkpoint needs for an exact resume.
//
// Scheme: workers x prefetch_factor slots, each with (B, T) int32 x/y buffers allocated once.
// Batch i always goes to slot i % slots and is made by worker i % workers (slots is a multiple
// of workers, so every slot belongs to one worker), each worker in increasing index order. A
// worker may fill batch i once the consumer has moved past batch i - slots, the one the slot
// held before: the consumer holds batch i until its next call to next(). next() waits for slot
// i % slots to hold batch i. A worker's exception is stored in its slot and rethrown by next()
// when that batch is due. Waiting is on condition variables, never spinning: the cores are
// shared with the OpenMP compute threads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kuai/core/tensor.h"
#include "kuai/data/batch_source.h"

namespace kuai::data {

struct LoaderOptions {
  int workers = 0;          // 0: batches are made on the caller's thread, inside next()
  int prefetch_factor = 2;  // ready-or-filling batches per worker
  double delay_ms = 0;      // artificial extra time per batch (benchmarks: a slow loader)
};

// (B, T) int32 tensors viewing a reusable slot buffer: valid until the next call to next() (or
// load_state, or the loader's destruction). Copy them (clone) to keep them longer.
struct Batch {
  Tensor x, y;
  int64_t index = -1;
};

struct LoaderState {
  int64_t next_index = 0;  // the next batch index to be delivered
};

// One consumer thread calls next(), state() and load_state(); the loader is not meant to be
// shared between consumers.
class DataLoader {
 public:
  DataLoader(std::shared_ptr<const BatchSource> source, LoaderOptions opts,
             int64_t start_index = 0);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Batch state().next_index; throws std::runtime_error("data worker <w>: <message>") if the
  // worker that made it failed (with workers == 0 the source's exception propagates as is).
  Batch next();
  double last_wait_ms() const { return last_wait_ms_; }  // how long the last next() blocked
  LoaderState state() const { return {next_index_}; }
  // Restart from state.next_index: stops the workers, discards everything prefetched, restarts.
  void load_state(const LoaderState& state);
  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  const LoaderOptions& options() const { return opts_; }

 private:
  enum class SlotState { kFree, kFilling, kReady, kFailed };
  struct Slot {
    Tensor x, y;  // (B, T) int32, allocated once
    int32_t* x_data = nullptr;
    int32_t* y_data = nullptr;
    int64_t index = -1;  // batch held or being filled
    SlotState state = SlotState::kFree;
    std::string error;  // kFailed: "data worker <w>: <message>"
  };

  void start_workers();
  void stop_workers();
  void worker_main(int worker, int64_t first_index);

  std::shared_ptr<const BatchSource> source_;
  LoaderOptions opts_;
  std::vector<Slot> slots_;
  int64_t next_index_ = 0;  // consumer thread only
  double last_wait_ms_ = 0;

  std::mutex mu_;                     // guards released_, stop_ and the slots' index/state/error
  std::condition_variable cv_free_;   // workers: a slot may have been released, or stop
  std::condition_variable cv_ready_;  // consumer: a slot became ready or failed
  int64_t released_ = 0;              // every batch below this is released by the consumer
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kuai::data
