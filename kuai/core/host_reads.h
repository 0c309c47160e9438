// Host reads: every copy of a tensor's value into host control flow (Tensor::item(), the fp16
// scaler's skip decision, a DDP stop flag) bumps a counter, per thread and in total. On a GPU
// each one is a synchronisation with the device; on the CPU device it is a load, but it is the
// same habit, and technique 10 is about not having it in the step loop. The trainer reports the
// reads its own thread made per step (RESULT host_reads_per_step=); a logger thread reading the
// metric ring steps later is counted too, on its own thread. Reads inside kernels (an optimizer
// kernel loading the clip factor) are the device reading its own memory and are not counted.
#pragma once

#include <cstdint>

namespace kuai {

void count_host_read();
int64_t host_reads_this_thread();
int64_t host_reads_total();

}  // namespace kuai
