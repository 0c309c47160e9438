// Learning-rate schedules (schedule.h).
#include "kuai/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kuai::optim {

double warmup_cosine_lr(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr_ratio,
                        int64_t step) {
  if (warmup_steps > 0 && step < warmup_steps)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
  const double min_lr = lr * min_lr_ratio;
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

WarmupCosineLR::WarmupCosineLR(Optimizer& opt, int64_t warmup_steps, int64_t total_steps,
                               double min_lr_ratio, double base_lr)
    : opt_(opt),
      base_lr_(base_lr < 0 ? opt.lr() : base_lr),
      warmup_(warmup_steps),
      total_(total_steps),
      min_ratio_(min_lr_ratio) {
  if (warmup_steps < 0 || total_steps < 1)
    throw std::invalid_argument("WarmupCosineLR: warmup_steps must be >= 0 and total_steps >= 1");
  opt_.set_lr(static_cast<float>(lr()));
}

double WarmupCosineLR::lr() const {
  return warmup_cosine_lr(base_lr_, warmup_, total_, min_ratio_, step_);
}

void WarmupCosineLR::step() {
  ++step_;
  opt_.set_lr(static_cast<float>(lr()));
}

}  // namespace kuai::optim
