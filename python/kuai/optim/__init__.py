"""kuai.optim: AdamW and SGD (kuai::optim), with PyTorch's arguments, and schedules.

The engine keeps the learning rate in float32 (a device tensor the update reads); the optimizers
here also keep the rate they were given as a Python float (``initial_lr``, as PyTorch's param
groups do), so a schedule computes its rates from the same double the CLI's trainer uses.
"""

from kuai._kuai.optim import Optimizer, warmup_cosine_lr  # noqa: F401
from kuai._kuai.optim import SGD as _SGD
from kuai._kuai.optim import AdamW as _AdamW
from kuai._kuai.optim import OffloadedAdamW as _OffloadedAdamW
from kuai._kuai.optim import lr_scheduler as _lr_scheduler


class AdamW(_AdamW):
    __doc__ = _AdamW.__doc__

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.initial_lr = float(lr)


class SGD(_SGD):
    __doc__ = _SGD.__doc__

    def __init__(self, params, lr=1e-2, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)
        self.initial_lr = float(lr)


class OffloadedAdamW(_OffloadedAdamW):
    """AdamW with its two moments in files under ``dir`` (offload, technique 8's other half),
    streamed through the update in ``chunk_mb`` chunks with io_uring: only the chunk buffers stay
    in memory (``buffer_bytes``), and the parameters equal in-memory AdamW's bit for bit."""

    def __init__(self, params, dir, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 chunk_mb=64):
        super().__init__(params, dir, lr=lr, betas=tuple(betas), eps=eps,
                         weight_decay=weight_decay, chunk_mb=chunk_mb)
        self.initial_lr = float(lr)


class _Schedulers:
    """kuai.optim.lr_scheduler"""

    class WarmupCosineLR(_lr_scheduler.WarmupCosineLR):
        """Linear warmup, then cosine decay to base_lr * min_lr_ratio (the trainer's schedule)."""

        def __init__(self, optimizer, warmup_steps, total_steps, min_lr_ratio=0.1, base_lr=None):
            if base_lr is None:
                base_lr = getattr(optimizer, "initial_lr", optimizer.lr)
            super().__init__(optimizer, warmup_steps, total_steps, min_lr_ratio, base_lr)


lr_scheduler = _Schedulers
