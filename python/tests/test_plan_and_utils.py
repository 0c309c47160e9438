"""kuai.plan on a model written in Python, and kuai.utils: recomputation under torch's name.

- kuai.plan(model_fn, ...) traces the real step of whatever model_fn builds on meta tensors: a GPT
  written in Python from kuai's layers is planned at the same peak as the built-in GPT, and the
  peak equals the allocator's peak of two real steps of that model, byte for byte;
- kuai.utils.checkpoint.checkpoint(block, x): gradients equal those without recomputation bit for
  bit, the region is replayed once per backward, and less is kept for backward.
"""

import numpy as np
import pytest

import kuai
import kuai.nn as nn
from test_train_equivalence import PyBlock, PyGPT

CFG = dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32)


def test_plan_of_a_python_model_is_its_measured_peak():
    cfg = nn.GPTConfig(**CFG)
    py = kuai.plan(lambda: PyGPT(cfg), batch_size=4, seq_len=32, quick=True)
    builtin = kuai.plan(lambda: nn.GPT(cfg, seed=1), batch_size=4, seq_len=32, quick=True)
    assert py["peak_bytes"] == builtin["peak_bytes"] > 0
    assert py["fits"] and py["step_s"] > 0 and py["result"].startswith("RESULT peak_mib=")
    assert py["persistent"]["optimizer"] >= 8 * sum(p.numel() for p in PyGPT(cfg).parameters())

    kuai.memory.empty_cache()
    base = kuai.memory.memory_allocated()
    kuai.memory.reset_peak_memory_stats()
    m = PyGPT(cfg)
    step = kuai.TrainStep(m, kuai.optim.AdamW(m.parameters(), lr=1e-3))
    x, y = kuai.randint(0, 256, [4, 32]), kuai.randint(0, 256, [4, 32])
    for _ in range(2):
        step(x, y)
    # the planned data slot is the loader's batch: x and y here, allocated before the reset
    measured = kuai.memory.max_memory_allocated() - base
    assert abs(measured - py["peak_bytes"]) <= 0.02 * py["peak_bytes"], (measured, py)

    with pytest.raises(TypeError, match="kuai.nn.Module"):
        kuai.plan(lambda: 3, batch_size=1, seq_len=4)


def test_checkpoint_recomputes_with_the_same_gradients():
    cfg = nn.GPTConfig(**CFG)
    kuai.manual_seed(5)
    block = PyBlock(cfg)
    x0 = kuai.randn(2, 32, 64)

    def grads(recompute):
        for p in block.parameters():
            p.grad = None
        x = x0.detach().requires_grad_()
        h = kuai.utils.checkpoint.checkpoint(block, x) if recompute else block(x)
        kuai.sum(h * h).backward()
        return [x.grad.numpy().copy()] + [p.grad.numpy().copy() for p in block.parameters()]

    kuai.utils.checkpoint.reset_recompute_stats()
    plain = grads(False)
    assert kuai.utils.checkpoint.recompute_stats()["replays"] == 0
    again = grads(True)
    stats = kuai.utils.checkpoint.recompute_stats()
    assert stats["regions"] == 1 and stats["replays"] == 1 and stats["dropped_bytes"] > 0
    for a, b in zip(plain, again):
        assert (a.view(np.uint32) == b.view(np.uint32)).all()
    with pytest.raises(ValueError, match="non-reentrant"):
        kuai.utils.checkpoint.checkpoint(block, x0, use_reentrant=True)
