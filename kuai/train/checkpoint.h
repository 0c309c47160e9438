// Full, resumable checkpoints (technique 9, the resume half; weights-only export is io/export.h).
// A checkpoint is a directory <run>/ckpt-<step>/ holding
//   model.safetensors            the parameters (fp32)
//   optimizer.rank0.safetensors  AdamW's exp_avg / exp_avg_sq per parameter, by parameter name
//   config.toml                  the run's resolved config
//   state.json                   step, optimizer step count, loader position, RNG keys, the loss
//                                scale (fp16 only), kuai version, and the size and xxh3 of
//                                every other file
// Saving copies the state into host buffers on the training thread (a memcpy into buffers kept
// from the previous save) and writes on a writer thread while training continues, at most one
// save in flight. Files go into
// ckpt-<step>.tmp/, are fsync'ed, the directory is fsync'ed and renamed into place, then the
// `latest` pointer file is replaced atomically and checkpoints beyond keep_last are removed: a
// crash or kill at any moment leaves the previous checkpoint and `latest` intact. Loading checks
// every file's size and checksum, the safetensors structure, names, shapes and dtypes, and names
// the file and the check that failed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kuai/amp/grad_scaler.h"
#include "kuai/data/loader.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/adamw.h"
#include "kuai/train/config.h"

namespace kuai::train {

struct TrainingState {
  int64_t step = 0;          // optimizer steps completed
  data::LoaderState loader;  // the next batch to train on
  uint64_t data_seed = 0;    // the loader's Philox key (batches are a function of it)
  std::string config_toml;   // the resolved config of the run
  // fp16's dynamic loss scale and its growth tracker; none in fp32 and bf16.
  std::optional<amp::GradScalerState> loss_scale;
};

struct SaveStats {
  std::string path;       // the checkpoint directory written
  double blocked_ms = 0;  // the training thread: waiting for the previous save + the snapshot
  double write_ms = 0;    // the writer: files, fsyncs, renames
  int64_t bytes = 0;      // on disk
};

class Checkpointer {
 public:
  Checkpointer(std::string run_dir, int64_t keep_last, bool async);
  ~Checkpointer();  // waits for a save in flight (errors are reported by wait(), not here)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Snapshots model, optimizer and state, then writes (now, or on the writer thread). First
  // waits for the previous save and rethrows its failure, if any. Returns the blocked time.
  double save(const nn::GPT& model, optim::AdamW& opt, const TrainingState& state);
  // Waits for the save in flight; rethrows its failure (std::runtime_error naming the file).
  void wait();
  SaveStats last_stats() const;
  const std::string& run_dir() const { return run_dir_; }

 private:
  struct Snapshot;
  void write(const Snapshot& s);
  void writer_main();

  std::string run_dir_;
  int64_t keep_last_;
  bool async_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unique_ptr<Snapshot> pending_;  // handed to the writer
  std::unique_ptr<Snapshot> spare_;    // written; its buffers are reused by the next save
  bool busy_ = false;                  // a save is being written
  bool stop_ = false;
  std::exception_ptr error_;
  SaveStats stats_;
  std::thread thread_;
};

struct Checkpoint {
  std::string path;  // the ckpt-<step> directory
  TrainingState state;
  int64_t optimizer_steps = 0;
};

// `path` is a checkpoint directory, or a run directory whose `latest` names one.
std::string resolve_checkpoint(const std::string& path);
// Reads and verifies state.json and every file's size and checksum.
Checkpoint read_checkpoint(const std::string& dir);
// Loads the model and optimizer tensors of a verified checkpoint (strict names/shapes/dtypes).
void restore_checkpoint(const Checkpoint& ckpt, nn::GPT& model, optim::AdamW& opt);

// The checkpoint directories of a run, oldest first.
std::vector<std::string> list_checkpoints(const std::string& run_dir);

}  // namespace kuai::train
