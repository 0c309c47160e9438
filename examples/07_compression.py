"""Technique 7: gradient compression around DDP's all-reduce (run it under mpirun).

The article: "HCCL compresses gradients to fp16 natively; just init_process_group(backend=
'hccl')". That is wrong: no collective library compresses gradients by itself; compression is a
cast before the collective (PyTorch's ``ddp_comm_hooks``), and it has to be asked for. kuai's
hooks, with PyTorch's call:

    model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)

run in C++ on the communication thread: each bucket is divided by the world size *first* (an
fp16 sum of gradients can overflow where their fp32 average would not), rounded to fp16 (or bf16),
summed in that dtype on the wire, and widened back. ``state=ErrorFeedback()`` keeps each
element's rounding error and adds it to the next step's gradient. Bytes on the wire halve; whether
the step gets faster depends on how much of the all-reduce was exposed to begin with.
"""

import _common

import kuai
import kuai.distributed as dist
from kuai.distributed.algorithms.ddp_comm_hooks import ErrorFeedback, default_hooks

args = _common.parse(__doc__, lambda p: p.add_argument(
    "--hook", default="fp16", choices=("fp16", "bf16", "none")))
args.error_feedback = args.hook != "none"
dist.init_process_group(backend="mpi" if dist.launched_by_mpi() else "single")
rank = dist.get_rank()


def train(hook):
    model = kuai.nn.parallel.DistributedDataParallel(_common.make_model(args))
    if hook is not None:
        model.register_comm_hook(ErrorFeedback() if args.error_feedback else None, hook)
    optimizer = _common.adamw(model, args)
    per_sync = model.bytes_per_sync  # (the reducer is built here: rank 0's weights broadcast)
    sent = dist.collective_stats()["bytes_sent"]
    for step, (data, target) in zip(range(args.steps), _common.make_loader(args)):
        loss = model(data, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    sent = dist.collective_stats()["bytes_sent"] - sent
    last = loss.detach().clone()
    dist.all_reduce(last, op=dist.ReduceOp.AVG)
    return per_sync, sent, float(last)


plain = train(None)
hooked = train(getattr(default_hooks, f"{args.hook}_compress_hook", default_hooks.allreduce_hook))
if rank == 0:
    _common.result(hook=args.hook, bytes_per_sync_fp32=plain[0], bytes_per_sync=hooked[0],
                   bytes_sent_fp32=plain[1], bytes_sent=hooked[1],
                   wire_ratio=hooked[1] / max(1, plain[1]), last_loss_fp32=plain[2],
                   last_loss=hooked[2])
dist.destroy_process_group()
