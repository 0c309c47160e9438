"""kuai.optim: AdamW and SGD (kuai::optim), with PyTorch's arguments, and schedules."""

from kuai._kuai.optim import SGD, AdamW, Optimizer, lr_scheduler, warmup_cosine_lr  # noqa: F401
