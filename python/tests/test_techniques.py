"""The techniques from Python, each equal to its plain version: autocast's dtypes, the GradScaler
loop against the engine's fp16 step, gradient accumulation (same gradients, smaller peak), the
compiled step against the eager one, and kuai.save/kuai.load (a bit-exact resume from a full
checkpoint; corrupt files named)."""

import os

import numpy as np
import pytest

import kuai
import kuai.nn as nn

CFG = dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32)


def make(seed=3, **over):
    kuai.manual_seed(seed)
    return nn.GPT(nn.GPTConfig(**dict(CFG, **over)), seed=seed)


def loader(corpus, batch=4, seed=7, start=0, seq=CFG["seq_len"]):
    src = kuai.data.RandomWindows(kuai.data.TokenFile(corpus), batch, seq, seed=seed)
    return kuai.data.DataLoader(src, num_workers=1, start_index=start)


def bits(t):
    return t.numpy().view(np.uint32).copy()


# ---- mixed precision ----

def test_autocast_dtypes_and_one_cast_per_parameter():
    lin = nn.Linear(8, 4)
    x = kuai.randn(2, 8)
    with kuai.amp.autocast("bf16"):
        assert kuai.amp.is_autocast_enabled()
        kuai.amp.reset_autocast_param_casts()
        y = lin(x)
        y2 = lin(x)
        assert y.dtype == kuai.bfloat16
        assert kuai.softmax(y, -1).dtype == kuai.float32  # precision-sensitive: fp32
        assert kuai.amp.autocast_param_casts() == 2  # weight and bias once, reused by y2
        del y2
    assert not kuai.amp.is_autocast_enabled()
    assert lin(x).dtype == kuai.float32
    with kuai.amp.autocast(kuai.float16):
        assert lin(x).dtype == kuai.float16
    with pytest.raises(ValueError, match="bf16"):
        kuai.amp.autocast("fp8")


def test_gradscaler_loop_equals_engine_fp16_step(corpus):
    """The article's loop (autocast fp16, scaler.scale(loss).backward(), scaler.step, update)
    gives the engine's fp16 TrainStep's losses and parameters bit for bit, and reads nothing on
    the host per step."""
    steps = 6
    a, b = make(), make()
    opt_a = kuai.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = kuai.optim.AdamW(b.parameters(), lr=1e-3)
    scaler = kuai.amp.GradScaler(init_scale=2.0**12, growth_interval=2)
    engine = kuai.TrainStep(b, opt_b, precision="fp16", max_grad_norm=1e30,
                            scaler=kuai.amp.GradScaler(init_scale=2.0**12, growth_interval=2))
    la, lb = [], []
    reads = kuai.host_reads()
    for (x, y), _ in zip(loader(corpus), range(steps)):
        with kuai.amp.autocast("fp16"):
            loss = a(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt_a)
        scaler.update()
        opt_a.zero_grad()
        la.append(loss.detach())
    assert kuai.host_reads() == reads  # the loop itself read no device value
    for (x, y), _ in zip(loader(corpus), range(steps)):
        lb.append(engine(x, y)["loss"])
    assert [float(v) for v in la] == [float(v) for v in lb]
    assert scaler.get_scale() == 2.0**12 * 2**3  # grew every 2 clean steps
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert (bits(p) == bits(q)).all(), n


def test_gradscaler_skips_overflow_and_backs_off():
    lin = nn.Linear(4, 4)
    opt = kuai.optim.SGD(lin.parameters(), lr=0.1)
    scaler = kuai.amp.GradScaler(init_scale=2.0**20)
    before = lin.weight.numpy().copy()
    loss = kuai.sum(lin(kuai.full([2, 4], 1e34)))  # the scaled gradients overflow
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert (lin.weight.numpy() == before).all()  # skipped
    assert scaler.get_scale() == 2.0**19
    assert scaler.state_dict() == {"scale": 2.0**19, "_growth_tracker": 0}
    with pytest.raises(RuntimeError, match="update"):
        scaler.update()


# ---- gradient accumulation ----

def test_accumulation_same_gradients_smaller_peak(corpus):
    """loss / accumulation_steps over 4 micro-batches of 2 == one batch of 8 (fp32 rounding), with
    a smaller peak of activation memory."""
    (x, y) = next(iter(loader(corpus, batch=8)))
    full, acc = make(), make()
    kuai.memory.reset_peak_memory_stats()
    base = kuai.memory.memory_allocated()
    full(x, y).backward()
    peak_full = kuai.memory.max_memory_allocated() - base
    xs, ys = x.numpy(), y.numpy()
    kuai.memory.reset_peak_memory_stats()
    base = kuai.memory.memory_allocated()
    for i in range(4):
        xi = kuai.from_numpy(xs[2 * i:2 * i + 2].copy())
        yi = kuai.from_numpy(ys[2 * i:2 * i + 2].copy())
        (acc(xi, yi) / 4).backward()
    peak_acc = kuai.memory.max_memory_allocated() - base
    for (n, p), (_, q) in zip(full.named_parameters(), acc.named_parameters()):
        np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=n)
    assert peak_acc < 0.7 * peak_full, (peak_acc, peak_full)


def test_trainstep_accumulation_equals_python_loop(corpus):
    a, b = make(), make()
    opt_a = kuai.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = kuai.optim.AdamW(b.parameters(), lr=1e-3)
    step = kuai.TrainStep(b, opt_b, accumulation_steps=2, max_grad_norm=1e30)
    la = loader(corpus, batch=2)
    lb = loader(corpus, batch=2)
    for _ in range(3):
        for _ in range(2):
            x, y = next(la)
            (a(x, y) / 2).backward()
        opt_a.step()
        opt_a.zero_grad()
        step(lb)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=0, atol=1e-6, err_msg=n)


# ---- graph compilation ----

@pytest.mark.parametrize("python_model", [False, True])
def test_compiled_step_equals_eager(corpus, python_model):
    """kuai.compile captures the step once and replays it; losses equal the eager step's. A loss
    written in Python is captured too, and not called again after the capture."""
    calls = []

    def run(compiled):
        m = make()
        opt = kuai.optim.AdamW(m.parameters(), lr=1e-3)
        fn = None
        if python_model:
            def fn(x, y):
                calls.append(compiled)
                return kuai.cross_entropy(m(x).reshape(-1, CFG["vocab_size"]), y.reshape(-1))
        make_step = kuai.compile if compiled else kuai.TrainStep
        step = make_step(m, opt, loss_fn=fn)
        losses = [step(x, y)["loss"] for (x, y), _ in zip(loader(corpus), range(5))]
        return step, [float(v) for v in losses]

    eager, le = run(False)
    comp, lc = run(True)
    assert comp.compiled and comp.captures == 1 and comp.replays == 4
    np.testing.assert_allclose(lc, le, rtol=1e-6)
    if python_model:
        assert calls.count(True) <= 2  # the capture (and a meta recording), not each replay
    with pytest.raises(TypeError, match="optimizer"):
        kuai.compile(make())


# ---- checkpoints ----

def test_save_load_state_dict_round_trip(tmp_path):
    m = make()
    path = tmp_path / "w.safetensors"
    kuai.save(m.state_dict(), path)
    sd = kuai.load(path)
    assert list(sd) == list(m.state_dict())
    for k, v in m.state_dict().items():
        assert (bits(sd[k]) == bits(v)).all()
    m2 = make(seed=9)
    m2.load_state_dict(sd)
    for (n, p), (_, q) in zip(m.named_parameters(), m2.named_parameters()):
        assert (bits(p) == bits(q)).all(), n


def test_full_checkpoint_resumes_bit_exact(corpus, tmp_path):
    """6 steps straight == 3 steps, kuai.save of everything, a fresh process state, kuai.load, 3
    more: the same losses and parameters bit for bit (fp16, so the scaler's state matters)."""

    def setup():
        m = make()
        opt = kuai.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
        sched = kuai.optim.lr_scheduler.WarmupCosineLR(opt, 2, 6)
        scaler = kuai.amp.GradScaler(init_scale=2.0**10, growth_interval=2)
        return m, opt, sched, scaler, loader(corpus)

    def train(m, opt, sched, scaler, ld, n):
        out = []
        for _ in range(n):
            x, y = next(ld)
            with kuai.amp.autocast("fp16"):
                loss = m(x, y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
            out.append(float(loss))
        return out

    m_straight, opt, sched, scaler, ld = setup()
    straight = train(m_straight, opt, sched, scaler, ld, 6)

    m, opt, sched, scaler, ld = setup()
    first = train(m, opt, sched, scaler, ld, 3)
    full = tmp_path / "full.safetensors"
    kuai.save({"model": m.state_dict(), "optimizer": opt.state_dict(),
               "scaler": scaler.state_dict(), "loader": ld.state_dict(),
               "scheduler": {"last_epoch": sched.last_epoch}, "step": 3}, full)
    light = tmp_path / "weights.safetensors"
    kuai.save(m.state_dict(), light)
    ratio = os.path.getsize(full) / os.path.getsize(light)
    assert 2.9 < ratio < 3.1, ratio  # weights + two AdamW moments

    ck = kuai.load(full)
    m2, opt2, sched2, scaler2, ld2 = setup()
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optimizer"])
    scaler2.load_state_dict(ck["scaler"])
    ld2.load_state_dict(ck["loader"])
    for _ in range(ck["scheduler"]["last_epoch"]):
        sched2.step()
    assert ck["step"] == 3 and opt2.step_count == 3
    second = train(m2, opt2, sched2, scaler2, ld2, 3)
    assert first + second == straight
    for (n, p), (_, q) in zip(m_straight.named_parameters(), m2.named_parameters()):
        assert (bits(p) == bits(q)).all(), n
    m3 = make()
    m3.load_state_dict(kuai.load(full)["model"])  # the checkpoint itself is still intact


def test_load_names_the_file_and_the_check(tmp_path):
    m = make()
    path = tmp_path / "w.safetensors"
    kuai.save({"model": m.state_dict(), "step": 1}, path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the last tensor
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="bad.safetensors.*checksum"):
        kuai.load(bad)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(RuntimeError, match="cut.safetensors"):
        kuai.load(cut)
    with pytest.raises(TypeError, match="set"):
        kuai.save({"x": {1, 2}}, tmp_path / "s.safetensors")


def test_optimizer_state_dict_checks_before_writing():
    m = make()
    opt = kuai.optim.AdamW(m.parameters(), lr=1e-3)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"exp_avg", "exp_avg_sq"} and sd["step"] == 0
    other = kuai.optim.AdamW(nn.Linear(3, 3).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="parameters"):
        other.load_state_dict(sd)
