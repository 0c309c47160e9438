// The host-read counters (see host_reads.h).
#include "kuai/core/host_reads.h"

#include <atomic>

namespace kuai {
namespace {

thread_local int64_t t_reads = 0;
thread_local int t_step_depth = 0;
std::atomic<int64_t> g_reads{0};

}  // namespace

void count_host_read() {
  ++t_reads;
  g_reads.fetch_add(1, std::memory_order_relaxed);
}

StepScope::StepScope() { ++t_step_depth; }
StepScope::~StepScope() { --t_step_depth; }
bool StepScope::active() { return t_step_depth > 0; }

void count_step_host_read() {
  if (t_step_depth > 0) count_host_read();
}

int64_t host_reads_this_thread() { return t_reads; }
int64_t host_reads_total() { return g_reads.load(std::memory_order_relaxed); }

}  // namespace kuai
