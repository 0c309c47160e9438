"""kuai.distributed.optim: ZeroRedundancyOptimizer, AdamW's state sharded across the ranks.

As ``torch.distributed.optim.ZeroRedundancyOptimizer``, each rank keeps Adam's moments for its
1/N of the parameters only, updates that part and all-gathers the updated parameters (ZeRO-1).
It *shards*; it does not offload to the CPU, whatever the well-known advice says: that is
``offload_dir=`` (the shard's moments in files on disk, streamed through the update), a separate
feature. ``stage=2`` also shards the gradients: DDP reduce-scatters each bucket into the shard
instead of all-reducing it, so pass the DDP-wrapped model as ``ddp=`` and run the step through
``kuai.TrainStep`` (which clips by the norm over the shards), or call ``step()`` without clipping.
``stage=3`` shards the parameters too: pass a ``kuai.distributed.fsdp.fully_shard`` model as
``ddp=`` (its units are gathered from the shards this optimizer holds).
"""

from kuai._kuai.distributed import ZeroAdamW as _ZeroAdamW
from kuai.optim import AdamW


class ZeroRedundancyOptimizer(_ZeroAdamW):
    """ZeroRedundancyOptimizer(params, optimizer_class=kuai.optim.AdamW, lr=..., betas=..., eps=...,
    weight_decay=..., *, stage=1, ddp=None, offload_dir=None)"""

    def __init__(self, params, optimizer_class=AdamW, *, stage=1, ddp=None, offload_dir=None,
                 lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs):
        if optimizer_class is not AdamW:
            raise TypeError("ZeroRedundancyOptimizer: kuai shards AdamW's state "
                            f"(optimizer_class=kuai.optim.AdamW), not {optimizer_class!r}")
        if kwargs:
            raise TypeError("ZeroRedundancyOptimizer() got unexpected keyword arguments: "
                            + ", ".join(sorted(kwargs)))
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroRedundancyOptimizer: stage must be 1, 2 or 3, got {stage}")
        reducer = None
        if ddp is not None:
            reducer = ddp._build_reducer()
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         reducer=reducer, stage=stage, offload_dir=offload_dir or "")
        self.initial_lr = float(lr)
        self._ddp = ddp
