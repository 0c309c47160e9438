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

// Marks the calling thread as running a training step while alive (nests). Inside one, host
// access to tensor bytes (Tensor::data<T>(), raw_data(), to_vector(), copy_to_host()) counts as a
// host read: on a device each is a synchronisation. Outside (setup, checkpoint I/O, the loader's
// host buffers) it does not. TrainStep / the trainer open one per step; compile opens one around
// a capture, so a step that reads device values that way is seen and runs eagerly.
class StepScope {
 public:
  StepScope();
  ~StepScope();
  StepScope(const StepScope&) = delete;
  StepScope& operator=(const StepScope&) = delete;
  static bool active();  // on this thread
};
// count_host_read() when this thread is inside a StepScope.
void count_step_host_read();

}  // namespace kuai
