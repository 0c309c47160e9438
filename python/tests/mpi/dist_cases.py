"""Multi-rank cases of the Python front end, run under mpirun by test_distributed.py:
``mpirun -np 2 /usr/bin/python3 dist_cases.py CASE CORPUS OUT.json``. Every rank runs the case;
rank 0 writes what it measured to OUT.json for the test to check. Each case also runs the plain
version (one process, the whole batch) inside every rank, so nothing is compared across runs."""

import json
import sys

import numpy as np

import kuai
import kuai.distributed as dist
import kuai.nn as nn
from kuai.distributed.algorithms.ddp_comm_hooks import ErrorFeedback, default_hooks
from kuai.distributed.fsdp import fully_shard
from kuai.distributed.optim import ZeroRedundancyOptimizer

CFG = dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32)
ROWS = 2  # per rank
STEPS = 4


def batches(corpus, rows, steps, seed=7):
    src = kuai.data.RandomWindows(kuai.data.TokenFile(corpus), rows, CFG["seq_len"], seed=seed)
    return [src[i] for i in range(steps)]


def my_rows(x, rank, rows=ROWS):
    a = x.numpy()[rank * rows:(rank + 1) * rows].copy()
    return kuai.from_numpy(a)


def model(seed=3):
    return nn.GPT(nn.GPTConfig(**CFG), seed=seed)


def flat(m):
    return np.concatenate([p.numpy().ravel() for p in m.parameters()])


def mean_over_ranks(loss):
    t = loss.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return float(t)


def sgd(params):
    return kuai.optim.SGD(params, lr=0.05, momentum=0.9)


def plain_run(corpus, world, steps=STEPS, accum=1, make_opt=None):
    """One process, the whole global batch: what DDP must equal."""
    m = model()
    opt = (make_opt or (lambda p: kuai.optim.AdamW(p, lr=1e-2)))(m.parameters())
    losses = []
    for x, y in batches(corpus, ROWS * world * accum, steps):
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, flat(m)


def case_ddp(corpus, rank, world):
    """The article's loop: DDP(model), loss.backward() (returns with averaged gradients), step."""
    m = nn.parallel.DistributedDataParallel(model())
    opt = kuai.optim.AdamW(m.parameters(), lr=1e-2)
    losses, sent = [], []
    for x, y in batches(corpus, ROWS * world, STEPS):
        before = dist.collective_stats()["bytes_sent"]
        loss = m(my_rows(x, rank), my_rows(y, rank))
        loss.backward()
        sent.append(dist.collective_stats()["bytes_sent"] - before)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    base_losses, base_params = plain_run(corpus, world)
    p = flat(m.module)
    return dict(losses=losses, base_losses=base_losses,
                max_param_diff=float(np.abs(p - base_params).max()),
                param_scale=float(np.abs(base_params).max()),
                bytes_sent=sent, bytes_per_sync=m.bytes_per_sync,
                in_backward=dist.collective_stats()["bytes_sent_in_backward"])


def case_no_sync(corpus, rank, world):
    """Accumulation under DDP: no_sync on the first micro-batch, one all-reduce per step; equals
    the whole batch of both micro-batches on one process."""
    accum = 2
    m = nn.parallel.DistributedDataParallel(model())
    opt = sgd(m.parameters())  # linear in the gradient: rounding is not amplified as by Adam
    losses, sent = [], []
    for x, y in batches(corpus, ROWS * world * accum, STEPS):
        xs, ys = x.numpy(), y.numpy()
        before = dist.collective_stats()["bytes_sent"]
        total = 0.0
        for i in range(accum):
            # micro-batch i: rows [i*world*ROWS + rank*ROWS, ...)
            lo = (i * world + rank) * ROWS
            xi = kuai.from_numpy(xs[lo:lo + ROWS].copy())
            yi = kuai.from_numpy(ys[lo:lo + ROWS].copy())
            if i + 1 < accum:
                with m.no_sync():
                    loss = m(xi, yi) / accum
                    loss.backward()
            else:
                loss = m(xi, yi) / accum
                loss.backward()
            total += mean_over_ranks(loss)
        sent.append(dist.collective_stats()["bytes_sent"] - before)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    base_losses, base_params = plain_run(corpus, world, accum=accum, make_opt=sgd)
    return dict(losses=losses, base_losses=base_losses,
                max_param_diff=float(np.abs(flat(m.module) - base_params).max()),
                param_scale=float(np.abs(base_params).max()), bytes_sent=sent,
                bytes_per_sync=m.bytes_per_sync)


def compressed_run(corpus, rank, world, hook, state):
    m = nn.parallel.DistributedDataParallel(model())
    if hook is not None:
        m.register_comm_hook(state, hook)
    opt = kuai.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    per_sync = m.bytes_per_sync  # builds the reducer: rank 0's weights are broadcast now
    before = dist.collective_stats()["bytes_sent"]
    for x, y in batches(corpus, ROWS * world, STEPS):
        loss = m(my_rows(x, rank), my_rows(y, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    # the loss averages add 4 bytes a step
    return losses, dist.collective_stats()["bytes_sent"] - before - 4 * STEPS, per_sync


def case_compression(corpus, rank, world):
    out = {}
    for name, hook, state in (("none", None, None),
                              ("fp16", default_hooks.fp16_compress_hook, None),
                              ("bf16_ef", default_hooks.bf16_compress_hook, ErrorFeedback())):
        losses, sent, per_sync = compressed_run(corpus, rank, world, hook, state)
        out[name] = dict(losses=losses, bytes_sent=sent, bytes_per_sync=per_sync)
    return out


def case_zero(corpus, rank, world):
    """ZeroRedundancyOptimizer (the article's call) against AdamW under the same DDP: the same
    parameters bit for bit, with about 1/world of the optimizer state; stage 3 over a fully_shard
    model too (its parameters gathered from the shards to be read); each stage compiled as well
    (kuai.TrainStep(compile=True): its collectives, and stage 3's gathers, captured)."""
    out = {}
    for name in ("adamw", "zero1", "zero2", "zero3", "zero1_compiled", "zero2_compiled",
                 "zero3_compiled"):
        compiled = name.endswith("_compiled")
        name_stage = name.split("_")[0]
        if name_stage == "zero3":  # fully_shard: the parameters sharded too
            m = fully_shard(model())
        else:
            m = nn.parallel.DistributedDataParallel(model())
        if name == "adamw":
            opt = kuai.optim.AdamW(m.parameters(), lr=1e-2)
        else:
            opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=kuai.optim.AdamW,
                                          lr=1e-2, stage=int(name_stage[-1]), ddp=m)
        step = kuai.TrainStep(m.module, opt, ddp=m, max_grad_norm=1e30, compile=compiled)
        losses = []
        for x, y in batches(corpus, ROWS * world, STEPS):
            losses.append(mean_over_ranks(step(my_rows(x, rank), my_rows(y, rank))["loss"]))
        state = (opt.state_bytes if name != "adamw"
                 else 8 * sum(p.numel() for p in m.parameters()))
        if name_stage == "zero3":
            with m.summon_full_params():
                params = flat(m.module)
        else:
            params = flat(m.module)
        out[name] = dict(losses=losses, params=params.view(np.uint32).tolist()[:4096],
                         checksum=int(params.view(np.uint32).astype(np.uint64).sum()),
                         state_bytes=state, captures=step.captures if compiled else None)
    return out


def case_loop_equals_trainstep(corpus, rank, world):
    """The Python DDP loop and the engine's TrainStep with ddp= give the same parameters bit for
    bit (clipping off in both: the step folds its factor into AdamW's pass)."""
    res = {}
    for name in ("loop", "step"):
        m = nn.parallel.DistributedDataParallel(model())
        opt = kuai.optim.AdamW(m.parameters(), lr=1e-2)
        step = kuai.TrainStep(m.module, opt, ddp=m, max_grad_norm=1e30) if name == "step" else None
        for x, y in batches(corpus, ROWS * world, STEPS):
            xr, yr = my_rows(x, rank), my_rows(y, rank)
            if step is not None:
                step(xr, yr)
            else:
                m(xr, yr).backward()
                opt.step()
                opt.zero_grad()
        res[name] = int(flat(m.module).view(np.uint32).astype(np.uint64).sum())
        res[name + "_first"] = flat(m.module)[:64].tolist()
    return res


def main():
    case, corpus, out = sys.argv[1:4]
    kuai.manual_seed(0)
    dist.init_process_group(backend="mpi", timeout=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    result = globals()["case_" + case](corpus, rank, world)
    result["world"] = world
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
