"""kuai.distributed.fsdp: ZeRO-3, the parameters sharded across the ranks too, as PyTorch's
``fully_shard`` (FSDP) does.

    model = fully_shard(kuai.nn.GPT(cfg))                    # the units: embedding, blocks, head
    opt = ZeroRedundancyOptimizer(model.parameters(), stage=3, ddp=model, lr=3e-4)
    loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

Each rank keeps 1/N of every unit's fp32 parameters (the masters, in the optimizer), of their
gradients and of AdamW's moments. A unit's parameters are all-gathered before its forward and
released after it (``reshard_after_forward``), gathered again for its backward, ``prefetch`` units
ahead on the communication thread; each unit's gradients are reduce-scattered into the shard as
soon as its backward is done. Between steps the parameters have no bytes: reading one is an error
that names it; ``with model.summon_full_params():`` gathers them all for reading (a collective).
``gather_dtype="bf16"`` gathers the products' weights in bf16 (half the traffic; run the forward
under ``kuai.autocast``), the fp32 shard staying the master. The engine's side is
``kuai::dist::ShardedParameters`` (docs/distributed.md, "ZeRO-3").

kuai shards a model by the units it names, so ``fully_shard`` takes a ``kuai.nn.GPT`` (GPT-2 or
LLaMA); FSDP's per-submodule calls (``fully_shard(block)`` for each block) are what these units
already are.
"""

from kuai.nn.parallel import DistributedDataParallel


class FullyShardedDataParallel(DistributedDataParallel):
    """The module ``fully_shard`` returns: a DDP wrapper whose reducer reduce-scatters each unit's
    gradients into the shards; the stage-3 optimizer then shards the parameters."""

    def __init__(self, module, *, reshard_after_forward=True, prefetch=1, gather_dtype=None):
        super().__init__(module)
        if gather_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"fully_shard: gather_dtype must be None, 'bf16' or 'fp16', "
                             f"not {gather_dtype!r}")
        self._options.update(zero3=True, reshard_after_forward=bool(reshard_after_forward),
                             prefetch=int(prefetch), gather_dtype=gather_dtype or "fp32")
        self._build_reducer()  # the units' buckets now: a wrong model is refused here

    def forward(self, *args, **kwargs):
        if not self._build_reducer().zero3_ready:
            raise RuntimeError("fully_shard: create the optimizer first, "
                               "ZeroRedundancyOptimizer(model.parameters(), stage=3, ddp=model): "
                               "it holds the parameter shards the forward gathers")
        return super().forward(*args, **kwargs)

    def summon_full_params(self):
        """Context manager: every unit gathered (its parameters readable) while it lives. A
        collective: every rank enters it."""
        return self._build_reducer().summon_full_params()


def fully_shard(module, *, reshard_after_forward=True, prefetch=1, gather_dtype=None):
    """ZeRO-3 over ``module`` (a kuai.nn.GPT): returns the wrapper to train, as
    ``DistributedDataParallel(module)`` does; build its optimizer with
    ``ZeroRedundancyOptimizer(model.parameters(), stage=3, ddp=model)``."""
    return FullyShardedDataParallel(module, reshard_after_forward=reshard_after_forward,
                                    prefetch=prefetch, gather_dtype=gather_dtype)
