// Full, resumable checkpoints (technique 9, the resume half; weights-only export is io/export.h).
// A checkpoint is a directory <run>/ckpt-<step>/ holding
//   model.safetensors            the parameters (fp32), whole; or, when the parameters are
//   model.rank<r>.safetensors    sharded (ZeRO-3), one file per rank holding that rank's pieces
//                                of them ("<name>" whole, "<name>@<first element>" 1-D), so that
//                                no rank ever holds the whole model to save or restore it
//   optimizer.rank<r>.safetensors  AdamW's exp_avg / exp_avg_sq by parameter name: one file
//                                (rank0) with every parameter whole, or with ZeRO one file per
//                                rank holding that rank's shard (see OptimizerShard)
//   config.toml                  the run's resolved config
//   state.json                   step, optimizer step count, loader position, RNG keys, the loss
//                                scale (fp16 only), kuai version, and the size and xxh3 of
//                                every other file
// Saving copies the state into host buffers on the training thread (a memcpy into buffers kept
// from the previous save) and writes on a writer thread while training continues, at most one
// save in flight. Offloaded optimizer state is streamed to its file before save() returns. Files go
// into ckpt-<step>.tmp/, are fsync'ed, the directory is fsync'ed and renamed into place, then the
// `latest` pointer file is replaced atomically and checkpoints beyond keep_last are removed: a
// crash or kill at any moment leaves the previous checkpoint and `latest` intact. Loading checks
// every file's size and checksum, the safetensors structure, names, shapes and dtypes, and names
// the file and the check that failed.
//
// With ZeRO on several ranks (a Checkpointer given the process group) every rank writes its own
// optimizer file into ckpt-<step>.tmp/ (and, with ZeRO-3, its model shard; rank 0 also the whole
// model at stages 1 and 2, and the config; the run directory must be one filesystem shared by the
// ranks), then commit() (a collective, run by the trainer one step after the save) gathers every
// file's size and checksum to rank 0, which writes state.json, renames and moves `latest` as
// above, and tells every rank whether the checkpoint is in place. Any checkpoint restores into any
// layout: sharded or whole, written by N ranks and read by M (re-sharding on load).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
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
#include "kuai/optim/offload_adamw.h"
#include "kuai/train/config.h"

namespace kuai::dist {
class ProcessGroup;
class ZeroAdamW;
}  // namespace kuai::dist

namespace kuai::train {

// What a checkpoint keeps of the optimizer on this rank: pieces of the parameters' AdamW moments.
// Unsharded AdamW: every parameter whole, stored with its shape as "exp_avg.<name>". ZeRO: the
// parts of parameters in this rank's shard, stored 1-D as "exp_avg.<name>@<first element>". Any
// pieces that cover every parameter restore into any others: a ZeRO checkpoint written by W ranks
// loads on W' ranks (re-sharding), or without ZeRO, and an unsharded one loads into ZeRO.
//
// Offloaded state (train.offload = disk) never sits whole in memory: its pieces name where they
// start in the flat moments (`first`) instead of tensors, and a save streams the optimizer file
// from the moments' files chunk by chunk, on the training thread before the save returns (the
// next update rewrites them); a resume streams the checkpoint's pieces back into fresh files.
struct OptimizerPiece {
  std::string param;           // the parameter's name in the model
  int64_t begin = 0;           // its first element here (of the flattened parameter)
  bool whole = true;           // the whole parameter
  Shape shape;                 // as stored: the parameter's shape (whole), else (elements)
  Tensor exp_avg, exp_avg_sq;  // contiguous fp32 views of the optimizer's state (in memory)
  int64_t first = -1;          // offloaded: the piece's first element in the flat moments
  // Offloaded with its master (train.offload_master): the parameter is a low-precision working
  // copy, and its fp32 values (the model file's) are in the masters file at `first`.
  bool master = false;
  // ZeRO-3: the piece's fp32 values (a contiguous view of the parameter shard, the master the
  // update writes); the model's parameter has no bytes between steps. Saved into this rank's
  // model shard file and restored there.
  Tensor values = {};
};
// With masters offloaded, a save streams the model file from the masters file too (in the same
// pass as the optimizer file), and a resume streams the model file's values back into it and
// into the working copies.
struct OptimizerShard {
  optim::Optimizer* optimizer = nullptr;         // its step count is saved and restored
  optim::OffloadedMoments* offloaded = nullptr;  // the moments' files (pieces by `first`)
  std::vector<OptimizerPiece> pieces;
  bool masters = false;  // some pieces are `master`
  // ZeRO with masters: rank 0 gathers every rank's masters into the model file as the ranks
  // stream their shards (a collective inside the save, dist::MasterGather).
  dist::ZeroAdamW* zero_masters = nullptr;
  // ZeRO-3: the model is saved as the pieces' `values`, one model.rank<r> file per rank.
  bool sharded_model = false;
};
OptimizerShard optimizer_shard(const nn::GPT& model, optim::AdamW& opt);
OptimizerShard optimizer_shard(const nn::GPT& model, optim::OffloadedAdamW& opt);
OptimizerShard optimizer_shard(const nn::GPT& model, dist::ZeroAdamW& opt);

struct TrainingState {
  int64_t step = 0;          // optimizer steps completed
  data::LoaderState loader;  // the next batch to train on
  uint64_t data_seed = 0;    // the loader's Philox key (batches are a function of it)
  std::string config_toml;   // the resolved config of the run
  // fp16's dynamic loss scale and its growth tracker; none in fp32 and bf16.
  std::optional<amp::GradScalerState> loss_scale;
  // The ranks the run trained on (its loader's rows per micro-batch are batch_size x ranks);
  // not the number of optimizer files, which only ZeRO writes one per rank of.
  int64_t ranks = 1;
};

struct SaveStats {
  std::string path;       // the checkpoint directory written
  double blocked_ms = 0;  // the training thread: waiting for the previous save + the snapshot
  double write_ms = 0;    // the writer: files, fsyncs, renames
  int64_t bytes = 0;      // on disk
};

class Checkpointer {
 public:
  // group: with ZeRO on several ranks, every rank constructs its Checkpointer with the group (a
  // collective) and writes its own optimizer shard; otherwise rank 0 alone saves (null).
  Checkpointer(std::string run_dir, int64_t keep_last, bool async,
               std::shared_ptr<dist::ProcessGroup> group = nullptr);
  ~Checkpointer();  // waits for a save in flight (errors are reported by wait(), not here)
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Snapshots model, optimizer and state, then writes (now, or on the writer thread). First
  // waits for the previous save and rethrows its failure, if any. Returns the blocked time.
  double save(const nn::GPT& model, const OptimizerShard& opt, const TrainingState& state);
  double save(const nn::GPT& model, optim::AdamW& opt, const TrainingState& state);
  // Waits for the save in flight (and commits it, with a group); rethrows its failure
  // (std::runtime_error naming the file).
  void wait();
  // With a group: a collective that puts the written checkpoint in place (see above); every rank
  // calls it at the same step. Nothing to do returns at once. Without a group: no-op.
  void commit();
  SaveStats last_stats() const;
  const std::string& run_dir() const { return run_dir_; }

 private:
  struct Snapshot;
  struct FileRecord {
    std::string name;
    uint64_t bytes = 0, xxh3 = 0;
  };
  std::string tmp_dir(int64_t step) const;
  void make_tmp_dir(int64_t step) const;  // fresh (one rank) or shared (a group)
  // The offloaded optimizer file, streamed into ckpt-<step>.tmp/ now; with masters (`model`),
  // the model file too, in the same pass, into *model_record.
  FileRecord stream_optimizer(const OptimizerShard& opt, int64_t step, const nn::GPT* model,
                              std::optional<FileRecord>* model_record);
  std::string optimizer_file() const;
  void wait_writer();  // the save in flight written; rethrows its failure
  void write(Snapshot& s);
  // This rank's files into ckpt-<step>.tmp/; their sizes and checksums into s.
  void write_files(Snapshot& s);
  // state.json over `files`, then the directory and `latest` into place, old ones pruned.
  void put_in_place(const Snapshot& s, const std::vector<FileRecord>& files);
  void writer_main();

  std::string run_dir_;
  int64_t keep_last_;
  bool async_;
  std::shared_ptr<dist::ProcessGroup> group_;
  bool uncommitted_ = false;  // with a group: a save written (or being written), not committed
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
  int64_t world_size = 1;      // optimizer files: optimizer.rank0 .. rank<world_size - 1>
  bool sharded_model = false;  // model.rank0 .. rank<world_size - 1>, not model.safetensors
};

// `path` is a checkpoint directory, or a run directory whose `latest` names one.
std::string resolve_checkpoint(const std::string& path);
// Reads and verifies state.json and every file's size and checksum.
Checkpoint read_checkpoint(const std::string& dir);
// Loads the model and optimizer tensors of a verified checkpoint (strict names/shapes/dtypes):
// every piece of `opt` from whichever optimizer files hold its elements, whatever the world size
// of the run that saved it. An element held by no file, or a stored tensor of no parameter, is an
// error naming the file or the parameter.
void restore_checkpoint(const Checkpoint& ckpt, nn::GPT& model, const OptimizerShard& opt);
void restore_checkpoint(const Checkpoint& ckpt, nn::GPT& model, optim::AdamW& opt);

// Loads only the model tensors of a verified checkpoint (strict names, shapes, dtypes), from the
// whole model file or from the model shards of every rank.
void restore_model(const Checkpoint& ckpt, nn::GPT& model);
// The model of a verified checkpoint one parameter at a time (fp32, assembled from the whole
// model file or the ranks' shards), without building it: fn(name, value) for each parameter of
// `cfg`'s model. At most one parameter is held (what `kuai export --hf` streams from).
void read_model_stream(const Checkpoint& ckpt, const nn::GPTConfig& cfg,
                       const std::function<void(const std::string& name, const Tensor& value)>& fn);

// For readers that take no lock (kuai sample --run beside a trainer that saves and prunes; see
// run_lock.h): the model of the newest committed checkpoint of `run_dir`, verified and loaded.
// Pruning renames a checkpoint away before removing it, so a reader finds it whole or not at all;
// when the checkpoint `latest` named is gone by the time it is read, `latest` is read again, up to
// `attempts` times (each retry reads the newest checkpoint, which has a whole save interval before
// it can be pruned; many attempts, so that a reader slowed for a moment, by a loaded machine or a
// sanitizer, still gets through). A reader that always takes longer than the trainer's save
// interval cannot win with keep_last = 1; it needs the lock or more checkpoints kept. Any other
// failure (a corrupt file) is thrown as it is.
struct CommittedModel {
  std::string path;  // the ckpt-<step> directory it came from
  int64_t step = 0;
  std::unique_ptr<nn::GPT> model;
};
CommittedModel read_latest_model(const std::string& run_dir, int attempts = 100);

// The step of a "ckpt-<step>" directory name, or -1 when the name is not one.
int64_t checkpoint_step_of(const std::string& name);
// The checkpoint directories of a run, oldest first.
std::vector<std::string> list_checkpoints(const std::string& run_dir);

}  // namespace kuai::train
