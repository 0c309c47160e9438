"""Technique 2: DistributedDataParallel, one process per rank (run it under mpirun).

The article (PyTorch on Ascend):

    dist.init_process_group(backend="hccl")
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

kuai, on CPUs, under ``mpirun -np 2 python3 examples/02_ddp.py``:

    dist.init_process_group(backend="mpi")
    model = kuai.nn.parallel.DistributedDataParallel(model)

Rank 0's weights are broadcast; every gradient is a view into a flat bucket; a bucket whose last
gradient is final is all-reduced on the communication thread while backward goes on, and
``loss.backward()`` returns once the buckets are averaged. The loop is the plain one.

Where the article is off: "hccl, not nccl" is about which library a backend wraps; the point of
DDP over DataParallel is one process per device (no GIL, no scatter of the batch each step), and
its speedup is measured, not a constant: the share of the all-reduce hidden behind backward
depends on the model, the buckets and the link (kuai's counters below, ``kuai bench ddp``).
"""

import _common

import kuai
import kuai.distributed as dist

args = _common.parse(__doc__)
dist.init_process_group(backend="mpi" if dist.launched_by_mpi() else "single")
rank, world = dist.get_rank(), dist.get_world_size()

model = kuai.nn.parallel.DistributedDataParallel(_common.make_model(args))
optimizer = _common.adamw(model, args)
loader = _common.make_loader(args)  # each rank reads its own rows of every batch

losses = []
for step, (data, target) in zip(range(args.steps), loader):
    loss = model(data, target)
    loss.backward()  # returns with the gradients averaged over the ranks
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.detach())

mean = [t.clone() for t in losses[:1] + losses[-1:]]
for t in mean:
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # the logged loss: the mean over ranks
stats = dist.collective_stats()
if rank == 0:
    _common.result(world=world, first_loss=float(mean[0]), last_loss=float(mean[-1]),
                   bytes_per_sync=model.bytes_per_sync, buckets=model.num_buckets,
                   # the share of the all-reduced bytes launched while backward still ran
                   overlap=stats["bytes_sent_in_backward"] / max(1, stats["bytes_sent"]))
dist.destroy_process_group()
