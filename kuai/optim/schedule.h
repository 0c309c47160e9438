// Learning-rate schedules. warmup_cosine_lr is the trainer's (train.warmup_steps, train.steps,
// train.min_lr_ratio): a linear warmup over the first warmup_steps steps, then a cosine decay to
// lr * min_lr_ratio at the last step. WarmupCosineLR drives an optimizer with it the way
// torch.optim.lr_scheduler does: it sets step 0's rate when made and the next one at each step().
#pragma once

#include <cstdint>

#include "kuai/optim/optimizer.h"

namespace kuai::optim {

// The rate at `step` (0-based), in double; the optimizer is given it as float.
double warmup_cosine_lr(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr_ratio,
                        int64_t step);

class WarmupCosineLR {
 public:
  // base_lr < 0: the optimizer's rate now.
  WarmupCosineLR(Optimizer& opt, int64_t warmup_steps, int64_t total_steps,
                 double min_lr_ratio = 0.1, double base_lr = -1);
  void step();  // to the next step's rate
  int64_t last_step() const { return step_; }
  double lr() const;  // the rate of the current step
  double base_lr() const { return base_lr_; }

 private:
  Optimizer& opt_;
  double base_lr_;
  int64_t warmup_, total_;
  double min_ratio_;
  int64_t step_ = 0;
};

}  // namespace kuai::optim
