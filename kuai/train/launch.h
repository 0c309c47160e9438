// The decisions `kuai launch` makes between the attempts of a job (apps/kuai/launch.cpp runs the
// processes): which hosts an MPI hostfile offers, how a job restarted on fewer ranks keeps its
// global batch, and which line of a failed job's output names what went wrong. Pure functions,
// so that each is tested without starting a process.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kuai::train {

// One line of an Open MPI hostfile: "node1 slots=2" (slots default to 1; "#" starts a comment;
// other keys such as max_slots are kept out of the count).
struct HostSlots {
  std::string host;
  int slots = 1;
};
// Throws std::invalid_argument naming the file and line of a line it cannot read.
std::vector<HostSlots> parse_hostfile(const std::string& text, const std::string& file_name);
std::string format_hostfile(const std::vector<HostSlots>& hosts);

// The per-rank batch and accumulation that keep the global batch (batch x ranks x accum) of a
// job on another number of ranks. The per-rank batch never grows (a rank's memory was sized for
// it); among the batches that divide the global batch evenly the largest even one is taken, and
// an odd one only when no even one fits: the loader draws its rows two per random block
// (data/batch_source.h), so the rows of a step are the same rows whatever their split only while
// every rank's batch is even. nullopt when no batch fits (a prime global batch on more ranks).
struct BatchSplit {
  int64_t batch_size = 0;
  int64_t accum_steps = 0;
};
std::optional<BatchSplit> keep_global_batch(int64_t batch_size, int64_t accum_steps, int64_t world,
                                            int64_t new_world);

// Whether a line of a job's output says the job is failing (kuai's line naming missing ranks or a
// deadline, mpirun's report of a lost process, an MPI_Abort): the launcher then gives mpirun its
// grace period to end.
bool names_a_failure(const std::string& line);

// The line of a failed job's output that best says why it failed, or "" when none does:
// kuai's own lines first (a rank naming the ranks and hosts that never reached a collective, a
// deadline, a failed checkpoint), then mpirun's (a process killed or exited, a lost daemon),
// then any error line of kuai's.
std::string failure_cause(const std::vector<std::string>& lines);

// The gist of a cause line for the restart line: which ranks on which hosts, and what of them
// ("rank 1 (on node1) never reached collective #12", "rank 1 on node1 exited on signal 9",
// "ranks 0 (on node0) do not answer"), or the line itself, cut to 160 characters.
std::string short_cause(const std::string& cause);

// The step of the checkpoint `<run>/latest` names, or -1 when the run has none (or it is not
// readable as one).
int64_t latest_checkpoint_step(const std::string& run_dir);

}  // namespace kuai::train
