"""Technique 8: optimizer state sharded across ranks (ZeRO) and offloaded to disk: two features.

The article:

    from torch.distributed.optim import ZeroRedundancyOptimizer
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                        lr=1e-4)

and calls it "offloading the optimizer state to the CPU". It is not: ZeroRedundancyOptimizer
*shards* AdamW's moments across the ranks (each keeps 1/N and updates its part of the
parameters, then the parts are all-gathered); nothing leaves the device. Offload is a separate
feature: kuai streams the moments (or a rank's shard of them) from files through the update in
chunks, so only the chunk buffers stay in memory (``kuai.optim.OffloadedAdamW``, or
``offload_dir=`` on the sharded one). The same call in kuai, under
``mpirun -np 2 python3 examples/08_zero_offload.py``:

    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kuai.optim.AdamW,
                                        lr=1e-4)

Both give the parameters plain AdamW gives, bit for bit (see python/tests).
"""

import tempfile

import numpy as np

import _common

import kuai
import kuai.distributed as dist
from kuai.distributed.optim import ZeroRedundancyOptimizer

args = _common.parse(__doc__)
dist.init_process_group(backend="mpi" if dist.launched_by_mpi() else "single")
rank, world = dist.get_rank(), dist.get_world_size()


def train(kind, offload_dir=None):
    net = _common.make_model(args)
    model = kuai.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    if kind == "zero":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=kuai.optim.AdamW,
                                            lr=args.lr, ddp=model if world > 1 else None)
        state = optimizer.state_bytes
    elif kind == "offload":
        optimizer = kuai.optim.OffloadedAdamW(model.parameters(), offload_dir, lr=args.lr,
                                              chunk_mb=1)
        state = optimizer.buffer_bytes  # what stays in memory: the chunk buffers
    else:
        optimizer = _common.adamw(model, args)
        state = 8 * sum(p.numel() for p in model.parameters())  # two fp32 moments
    for step, (data, target) in zip(range(args.steps), _common.make_loader(args)):
        loss = model(data, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = np.concatenate([p.numpy().ravel() for p in net.parameters()])
    return state, weights


adamw_state, adamw_w = train("adamw")
zero_state, zero_w = train("zero")
with tempfile.TemporaryDirectory() as d:
    off_state, off_w = train("offload", f"{d}/rank{rank}")
if rank == 0:
    same = lambda w: bool((w.view(np.uint32) == adamw_w.view(np.uint32)).all())  # noqa: E731
    _common.result(world=world, adamw_state_bytes=adamw_state, zero_state_bytes=zero_state,
                   zero_state_ratio=zero_state / adamw_state,
                   offload_resident_bytes=off_state,
                   zero_equals_adamw=same(zero_w), offload_equals_adamw=same(off_w))
dist.destroy_process_group()
