"""kuai.distributed.fsdp.fully_shard (ZeRO-3) from Python, in one process (the 2-rank case is
mpi/dist_cases.py's "zero"): the loop PyTorch's users write (loss.backward(), opt.step()) with
ZeroRedundancyOptimizer(stage=3) trains a GPT as plain AdamW does, bit for bit (one rank: every
unit gathered from a shard of everything, its gradients reduce-scattered over one); between steps
a parameter has no bytes and reading it is an error naming it; summon_full_params() gathers them;
a model without units and a forward before the optimizer are refused by name."""

import numpy as np
import pytest

import kuai
import kuai.distributed as dist
import kuai.nn as nn
from kuai.distributed.fsdp import fully_shard
from kuai.distributed.optim import ZeroRedundancyOptimizer

CFG = dict(vocab_size=256, n_layer=2, n_head=2, d_model=32, seq_len=16)


@pytest.fixture(autouse=True)
def one_process_group():
    if not dist.is_initialized():
        dist.init_process_group(backend="single")
    yield


def batches(corpus, steps=3):
    src = kuai.data.RandomWindows(kuai.data.TokenFile(corpus), 4, CFG["seq_len"], seed=5)
    return [src[i] for i in range(steps)]


def flat(m):
    return np.concatenate([p.numpy().ravel() for p in m.parameters()])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fully_shard_trains_as_adamw_bit_for_bit(corpus, family):
    cfg = dict(CFG, family=family)
    plain = nn.GPT(nn.GPTConfig(**cfg), seed=3)
    adamw = kuai.optim.AdamW(plain.parameters(), lr=1e-2)
    model = fully_shard(nn.GPT(nn.GPTConfig(**cfg), seed=3), prefetch=1)
    opt = ZeroRedundancyOptimizer(model.parameters(), lr=1e-2, stage=3, ddp=model)
    assert opt.stage == 3
    for x, y in batches(corpus):
        a = plain(x, y)
        a.backward()
        adamw.step()
        adamw.zero_grad()
        b = model(x, y)
        b.backward()
        opt.step()
        opt.zero_grad()
        assert float(a) == float(b)
    with model.summon_full_params():
        sharded = flat(model.module)
    assert np.array_equal(sharded, flat(plain))
    with pytest.raises(RuntimeError, match="released"):
        model.module.parameters()[0].numpy()


def test_fully_shard_refuses_what_it_cannot_shard():
    with pytest.raises(TypeError, match="units"):
        fully_shard(nn.Linear(4, 4))
    model = fully_shard(nn.GPT(nn.GPTConfig(**CFG), seed=1))
    x = kuai.from_numpy(np.zeros((1, 4), dtype=np.int32))
    with pytest.raises(RuntimeError, match="create the optimizer first"):
        model(x, x)
    with pytest.raises(ValueError, match="stage 3"):
        ZeroRedundancyOptimizer(model.parameters(), lr=1e-2, stage=1, ddp=model)
