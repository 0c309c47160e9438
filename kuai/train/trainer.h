// The training loop. One optimizer step = `accum_steps` micro-batches from the prefetching
// DataLoader (forward, loss / k, backward: gradients add up in .grad), a device-side gradient
// norm and clip factor, one AdamW pass that applies the factor, and a push of the step's device
// scalars into the metric ring; nothing in the loop reads a device value on the host (unless
// log.sync_every_step asks for the slow habit, for the benchmark). Evaluation on the held-out
// split every `eval_every` steps. Writes runs/<name>/ (config.toml, metrics.jsonl, TensorBoard
// events, model.safetensors) and ends with a RESULT summary line.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "kuai/distributed/process_group.h"
#include "kuai/nn/gpt.h"
#include "kuai/optim/optimizer.h"
#include "kuai/train/config.h"

namespace kuai::train {

struct TrainResult {
  std::vector<float> losses;                          // per optimizer step
  std::vector<float> grad_norms;                      // per optimizer step, before clipping
  std::vector<std::pair<int64_t, float>> val_losses;  // (step, held-out loss)
  std::vector<double> step_ms;                        // per step, host wall time
  std::vector<double> data_wait_ms;                   // per step: time blocked on the loader
  double tokens_per_s = 0;                            // from the median step time (step 1 excluded)
  double step_ms_median = 0;
  double data_wait_ms_median = 0;
  double peak_rss_mib = 0;
  int64_t peak_alloc_bytes = 0;         // allocator peak over the run (live tensors)
  int64_t peak_alloc_steady_bytes = 0;  // ... over steps 2..N (0 when there is one step)
  // The live bytes at the start of steps 2..N (the most): parameters, optimizer state, what the
  // step keeps between steps. peak_alloc_steady_bytes above it is what a step's forward and
  // backward take (activations, their gradients, the parameters' gradients, scratch).
  int64_t step_start_bytes = 0;
  double minor_faults_per_step = 0;  // page faults of the process per step, steps 2..N
  double rss_steady_max_mib = 0;     // largest resident set sampled after steps 2..N
  int64_t alloc_reserved_bytes = 0;  // what the allocator holds at the end (live + cached)
  double rss_max_mib = 0;            // largest resident set sampled after each step of this run
  float final_loss = 0;
  int64_t skipped_steps = 0;  // fp16: steps the scaler skipped (inf/NaN gradients), as logged
  int64_t steps_done = 0;
  bool interrupted = false;
  std::string run_path;    // runs/<name>, empty when no run directory was written
  int64_t start_step = 0;  // > 0 when resumed
  // Measured over the steps (each step from its start to its update; not evaluation, saves or
  // the logger): host reads made by the training thread per step (core/host_reads.h), MiB this
  // rank handed to collectives per step, and the share of its all_reduce / reduce_scatter bytes
  // launched while backward was still running (DDP's overlap; 0 alone).
  double host_reads_per_step = 0;
  double comm_mib_per_step = 0;
  // Every byte each rank handed to collectives in the whole run (setup, steps, evaluation,
  // checkpoints), gathered at the end: what a network link between hosts must at least have
  // carried.
  std::vector<int64_t> comm_bytes_sent_by_rank;
  double overlap = 0;
  // The share of the communication thread's time on those collectives (start to completion,
  // compression hooks included) that passed while backward was still running: the overlap in
  // time. 0 alone, or with a group that has no communication thread.
  double overlap_time = 0;
  // That time per step, in milliseconds: the collectives' time from launch to completion.
  double comm_ms_per_step = 0;
  // ZeRO-3: milliseconds per step the training thread waited for its units' gathers (what
  // prefetch did not hide); 0 otherwise.
  double gather_wait_ms_per_step = 0;
  // train.compile: captures made (re-captures after a guard failed included), whether the step
  // fell back to eager, the graph's arena and node count.
  int64_t compile_captures = 0;
  bool compile_eager = false;
  int64_t compile_arena_bytes = 0;
  int64_t compile_nodes = 0;
  int64_t checkpoints_saved = 0;
  int64_t save_failures = 0;
  std::string save_error;               // the last failed save's message
  std::vector<double> save_blocked_ms;  // per save: time the step loop was blocked
};

struct StepParts;

struct TrainOptions {
  bool write_run_dir = true;                // runs/<name>/ with config, metrics, weights
  bool terminal = false;                    // stdout is a terminal: log.progress = auto -> bar
  const std::atomic<bool>* stop = nullptr;  // set (by SIGINT) -> stop after the current step
  bool quiet = false;                       // no header/summary lines (benchmarks)
  std::string resume;  // a checkpoint or run directory to continue from (cfg must match it)
  std::function<void(int64_t step)> after_step;  // tests: called after each optimizer step
  std::function<void(StepParts&)> built;         // tests: called once the step's parts exist
  // The ranks of the run; null: MPI_COMM_WORLD when launched by mpirun, else one process. With
  // more than one rank the model is wrapped in DDP, each rank reads its own shard of every batch
  // (train.batch_size rows per rank), metrics are averaged over ranks, and only rank 0 writes
  // the run directory, logs, checkpoints and weights.
  std::shared_ptr<dist::ProcessGroup> group;
};

// The usual AdamW grouping: weight decay on matmul weights (2-D ".weight" outside the
// embeddings), none on biases, LayerNorm and embeddings.
std::vector<optim::ParamGroup> param_groups(const nn::Module& model, float weight_decay);

// Learning rate at `step` (0-based): linear warmup, then cosine decay to lr * min_lr_ratio.
double learning_rate(const TrainConfig& cfg, int64_t step);

// One micro-batch: forward, loss * loss_scale, backward (gradients add into .grad). Returns the
// unscaled mean loss, detached, as a device tensor: not read on the host.
Tensor forward_backward(const nn::GPT& model, const Tensor& x, const Tensor& y, float loss_scale);
// The same with the factor a one-element device tensor (the fp16 scaler's scale / k): the
// multiply runs on the device, so the host never reads the scale.
Tensor forward_backward(const nn::GPT& model, const Tensor& x, const Tensor& y,
                        const Tensor& loss_scale);

TrainResult run_training(const TrainConfig& cfg, std::ostream& log,
                         const TrainOptions& options = {});

// The line every run ends with: "RESULT tokens_per_s=... step_ms_median=... peak_rss_mib=...
// final_loss=...".
std::string result_line(const TrainResult& r);
// How far steps 2..N peaked above their start (TrainResult::step_start_bytes); 0 with one step.
int64_t step_peak_bytes(const TrainResult& r);

double peak_rss_mib();     // the process's peak resident set so far (getrusage)
double current_rss_mib();  // resident set now (/proc/self/statm)
int64_t minor_faults();    // the process's minor page faults so far (getrusage)

// SIGINT sets the flag returned here (a second Ctrl-C kills as usual).
const std::atomic<bool>* install_sigint_stop();

}  // namespace kuai::train
