#!/usr/bin/python3
"""Writes tests/golden/tiny_gpt_amp.safetensors: PyTorch's bf16 CPU autocast reference for one
forward and backward of the tiny GPT of tests/golden/tiny_gpt.safetensors.

Run by hand with Debian's torch, after make_golden.py (CI never runs it; the fixture is
committed):

    /usr/bin/python3 tests/golden/make_golden_amp.py [--native-only]

Model, configuration and the safetensors reader/writer are make_golden.py's (imported). The
parameters, idx and targets are read from tiny_gpt.safetensors, so both fixtures describe the
same weights and batch; the script checks that its fp32 forward/backward reproduces that
fixture's logits, loss and gradients bit for bit before it writes anything. The fixture holds:
    logits         F32  (B, T, V) bf16 logits of the forward under
                        torch.autocast("cpu", dtype=torch.bfloat16), widened exactly to F32
    loss           F32  [1] its cross-entropy (fp32, see below)
    grad.<name>    F32  parameter gradients of that forward's backward (autocast off, as usual)
    f64.logits     F32  the same forward in float64 (no autocast), rounded to F32: the truth
    f64.loss       F32  [1]
    f64.grad.<name> F32
    emu.logits, emu.loss, emu.grad.<name>  F32
                        float64 model of KUAI's policy: the model in float64 with a bf16
                        rounding exactly where kuai stores a bf16 tensor (and its gradient) and
                        every sum exact (emulate(..., "kuai") below); kuai's fp32-accumulated
                        result must match it up to rare rounding-tie flips
    loss_fp32      F32  [1] the fp32 loss (no autocast): equal to tiny_gpt.safetensors' `loss`,
                        which lets the C++ test detect a stale pair of fixtures
The float64 results are stored rounded to F32 (relative error 2^-24), four orders of magnitude
below the bf16 differences they are used to judge; it halves the fixture. The fp32 (no autocast)
results are tiny_gpt.safetensors' logits, loss and grad.<name>. If kuai's autocast policy
changes (where it rounds), update emulate() and regenerate.

PyTorch's own bf16 result is a loose reference here: Debian's torch 1.13 on a CPU without
AVX512-BF16 multiplies bf16 matrices on its reference GEMM path, which accumulates in bf16
(pytorch/pytorch#83863 and #95125, fixed by #96074 after 1.13; a (64x33)@(33x64) product is
0.7% off, 4x the rounding of the exact result). Its gradients are therefore 1.1e-2..3.6e-2
(relative Frobenius) from float64, where the same rounding points with exact sums (emulate(...,
"torch")) give 2.9e-3..8.7e-3; its logits (short sums) are 3.8e-3 off either way. The script
prints these distances.

Which op runs in which dtype (PyTorch 1.13 CPU autocast, observed with a TorchDispatchMode and
asserted by check_dtypes() below every time the script runs), against kuai's policy:
    op                      PyTorch 1.13 CPU autocast            kuai AutocastGuard(kBF16)
    embedding (wte, wpe)    fp32                                 fp32
    residual add            fp32 + bf16 -> fp32                  fp32 (promotion)
    layer_norm              fp32 (its input is the fp32 stream)  fp32 (policy kFloat32)
    linear (addmm/mm)       bf16 in, bf16 out, bias cast to bf16 bf16 in, bf16 out
    attention q k^T         bmm -> bf16 scores                   fused: fp32 scores
    * 1/sqrt(hd), mask      bf16 (one more rounding)             fused: fp32
    softmax                 bf16 in, bf16 out (NOT fp32-listed   fused: fp32 math, probs
                            on CPU in 1.13)                      rounded to bf16 and saved
    p v                     bmm bf16                             fused: fp32 probs, bf16 out
    gelu                    bf16 in/out                          bf16 in/out, fp32 math
    lm_head (tied wte)      F.linear -> bf16 logits              bf16 logits
    cross_entropy           fp32 list: logits widened to fp32,   reads bf16 logits, fp32 math,
                            fp32 log_softmax / nll               no fp32 copy
  backward (autocast off; dtypes follow the forward):
    dlogits                 fp32, rounded to bf16 by the cast's  fp32 math, rounded once to
                            backward                             bf16
    linear dW, dx, db       bf16 mm / bf16 sum (db), widened to  bf16 weight/bias gradients,
                            fp32 at the cast to the fp32 param   widened through the cast
    softmax backward        bf16 (from the saved bf16 probs)     fused attention backward in
                                                                 fp32 from the saved bf16 probs
    gelu backward           bf16                                 bf16 (fp32 math)
    layer_norm backward     fp32                                 fp32
    embedding backward      fp32 (wte: + the widened lm_head     fp32 (same)
                            bf16 gradient)
So the two engines agree on where the parameters are cast and on every linear/gelu rounding;
they differ inside attention, where PyTorch rounds the scores, the scaled/masked scores and the
probabilities to bf16 (and runs softmax's backward in bf16), while kuai's fused primitive
rounds only the probabilities and the output. Both are legitimate bf16 autocast results; the
C++ test therefore judges kuai's distance to PyTorch-bf16 against PyTorch-bf16's own distance
to the float64 truth, and kuai's rounding points against emu (tests/nn/test_gpt_golden_amp.cpp).
"""

import copy
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_golden as mg  # noqa: E402  (model, CONFIG, safetensors reader/writer)

torch_gpt = mg.torch_gpt
SOURCE = mg.OUTPUT  # tests/golden/tiny_gpt.safetensors
OUTPUT = os.path.join(HERE, "tiny_gpt_amp.safetensors")
# The float64 model of kuai's policy on CPUs that multiply bf16 natively (AVX512-BF16, AMX):
# attention's probabilities are rounded to bf16 before p v, and its score gradient ds before
# ds k and ds^T q, so that every product runs bf16 x bf16 (emulate(..., "kuai_native")).
# emu_native.logits, emu_native.loss, emu_native.grad.<name> (F32). A float64 computation from
# tiny_gpt.safetensors' weights and batch only, so `--native-only` writes it on any machine
# without touching the PyTorch-bf16 fixture (whose torch results depend on the CPU).
NATIVE_OUTPUT = os.path.join(HERE, "tiny_gpt_amp_native.safetensors")


class DtypeLog(TorchDispatchMode):
    """Records {aten op name: set of (input dtypes, output dtypes)} below autocast."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def dtypes(tree):
            return tuple(str(t.dtype)[6:] for t in tree_flatten(tree)[0] if torch.is_tensor(t))

        name = str(func.overloadpacket).split(".")[-1]
        self.seen.setdefault(name, set()).add((dtypes((args, kwargs)), dtypes(out)))
        return out


def check_dtypes(model, idx, targets, ignore_index):
    """Asserts the dtype table of the docstring on a copy of the model."""
    m = copy.deepcopy(model)
    fwd, bwd = DtypeLog(), DtypeLog()
    with torch.autocast("cpu", dtype=torch.bfloat16), fwd:
        loss = torch_gpt.loss_fn(m(idx), targets, ignore_index)
    with bwd:
        loss.backward()

    def outs(log, op):
        assert op in log.seen, f"{op} not dispatched"
        return {o for _, o in log.seen[op]}

    bf, f32 = "bfloat16", "float32"
    assert outs(fwd, "embedding") == {(f32,)}
    assert outs(fwd, "native_layer_norm") == {(f32, f32, f32)}
    assert all(i == (f32, f32, f32) for i, _ in fwd.seen["native_layer_norm"])
    for op in ("addmm", "mm", "bmm", "mul", "masked_fill", "_softmax", "gelu"):
        assert outs(fwd, op) == {(bf,)}, (op, fwd.seen[op])
    assert outs(fwd, "_log_softmax") == {(f32,)} and outs(fwd, "nll_loss_forward") == {(f32, f32)}
    assert {i for i, _ in fwd.seen["_log_softmax"]} == {(f32,)}  # logits widened first
    assert outs(fwd, "add") == {(f32,)}  # residual stream stays fp32
    for op in ("mm", "bmm", "_softmax_backward_data", "gelu_backward"):
        assert outs(bwd, op) == {(bf,)}, (op, bwd.seen[op])
    assert outs(bwd, "native_layer_norm_backward") == {(f32, f32, f32)}
    assert outs(bwd, "_log_softmax_backward_data") == {(f32,)}
    assert outs(bwd, "embedding_dense_backward") == {(f32,)}
    assert all(p.grad.dtype == torch.float32 for p in m.parameters())


# ---- float64 emulation of a bf16 autocast policy -------------------------------------------
# The model in float64 with a bf16 rounding exactly where a policy stores a bf16 tensor, and
# nothing else rounded: every sum is exact. R() rounds a bf16 tensor when it is made and its
# gradient when that is made (in both engines the gradient of a bf16 tensor is bf16; every bf16
# tensor here has one consumer, or disjoint ones, so rounding it where it arrives is the same).


def bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


class R(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return bf16(x)

    @staticmethod
    def backward(ctx, g):
        return bf16(g)


class SoftmaxSavedBf16(torch.autograd.Function):
    """PyTorch's bf16 softmax: output rounded; its backward uses that rounded output."""

    @staticmethod
    def forward(ctx, x):
        p = bf16(torch.softmax(x, dim=-1))
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return p * (g - (g * p).sum(-1, keepdim=True))


class KuaiAttention(torch.autograd.Function):
    """kuai's fused attention on bf16 q, k, v (backend/cpu/eval_attention.cpp): scores, softmax
    and p v in fp32, y rounded from the unrounded p; p rounded and saved; backward in fp32 from
    the saved bf16 p (ds = scale p (dp - rowsum(p dp))); dq, dk, dv rounded (by R on qkv)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        T = q.shape[-2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        s = (q @ k.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1)
        pb = bf16(p)
        ctx.save_for_backward(q, k, v, pb)
        ctx.scale = scale
        return bf16(p @ v)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, p = ctx.saved_tensors
        dp = dy @ v.transpose(-2, -1)
        ds = ctx.scale * p * (dp - (p * dp).sum(-1, keepdim=True))
        return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dy, None


class KuaiNativeAttention(torch.autograd.Function):
    """KuaiAttention where the CPU multiplies bf16 natively (cpu::gemm_lowp_round_a): y from the
    rounded (and saved) p; ds rounded before ds k and ds^T q. Everything else as KuaiAttention."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        T = q.shape[-2]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        s = (q @ k.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))
        pb = bf16(torch.softmax(s, dim=-1))
        ctx.save_for_backward(q, k, v, pb)
        ctx.scale = scale
        return bf16(pb @ v)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, p = ctx.saved_tensors
        dp = dy @ v.transpose(-2, -1)
        ds = bf16(ctx.scale * p * (dp - (p * dp).sum(-1, keepdim=True)))
        return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dy, None


def emulate(params, idx, targets, c, policy):
    """One forward/backward of the GPT in float64 with policy's bf16 roundings: "torch" (PyTorch
    1.13 CPU autocast, as observed), "kuai" (kuai's AutocastGuard), "kuai_native" (the same on a
    CPU with native bf16) or "none" (plain float64,
    checked against torch_gpt.GPT in float64). Returns logits, loss, {name: grad}."""
    r = (lambda x: x) if policy == "none" else R.apply
    P = {n: t.detach().double().requires_grad_() for n, t in params.items()}
    B, T = idx.shape
    C, H = c["d_model"], c["n_head"]
    hd = C // H
    eps = torch_gpt.LAYERNORM_EPS

    def linear(x, pre):  # autocast: x, W, b cast to bf16; the output bf16
        return r(torch.nn.functional.linear(r(x), r(P[pre + ".weight"]), r(P[pre + ".bias"])))

    def ln(x, pre):  # fp32 in both engines
        return torch.nn.functional.layer_norm(x, (C,), P[pre + ".weight"], P[pre + ".bias"], eps)

    x = P["wte.weight"][idx] + P["wpe.weight"][:T]  # fp32 embeddings, fp32 residual stream
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(c["n_layer"]):
        pre = f"h.{i}."
        q, k, v = linear(ln(x, pre + "ln_1"), pre + "attn.c_attn").split(C, dim=2)
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, v))
        if policy == "kuai":
            y = KuaiAttention.apply(q, k, v, 1.0 / hd**0.5)
        elif policy == "kuai_native":
            y = KuaiNativeAttention.apply(q, k, v, 1.0 / hd**0.5)
        else:
            s = r(r(q @ k.transpose(-2, -1)) * (1.0 / hd**0.5)).masked_fill(~mask, float("-inf"))
            p = torch.softmax(s, dim=-1) if policy == "none" else SoftmaxSavedBf16.apply(s)
            y = r(p @ v)
        x = x + linear(y.transpose(1, 2).reshape(B, T, C), pre + "attn.c_proj")
        h = linear(ln(x, pre + "ln_2"), pre + "mlp.c_fc")
        h = r(torch.nn.functional.gelu(h, approximate="tanh"))  # bf16 in, bf16 out
        x = x + linear(h, pre + "mlp.c_proj")
    logits = r(torch.nn.functional.linear(r(ln(x, "ln_f")), r(P["wte.weight"])))
    loss = torch_gpt.loss_fn(logits, targets, c["ignore_index"])  # fp32 math on bf16 logits
    loss.backward()
    return logits.detach(), loss.detach().reshape(1), {n: t.grad for n, t in P.items()}


def forward_backward(model, idx, targets, ignore_index, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(idx)
        loss = torch_gpt.loss_fn(logits, targets, ignore_index)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach().clone(), loss.detach().reshape(1).clone(), grads


def rel(a, b):
    """Relative Frobenius distance ||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def write_native_emulation(src, c, names):
    """NATIVE_OUTPUT: kuai's policy on a native-bf16 CPU, emulated in float64."""
    params = {n: src[f"param.{n}"] for n in names}
    idx, targets = src["idx"].long(), src["targets"].long()
    logits, loss, grads = emulate(params, idx, targets, c, "kuai_native")
    out = [("emu_native.logits", logits.float()), ("emu_native.loss", loss.float())]
    out += [(f"emu_native.grad.{n}", grads[n].float()) for n in names]
    out += [("loss_fp32", src["loss"])]
    metadata = {k: str(v) for k, v in c.items()}
    metadata["source"] = os.path.basename(SOURCE)
    metadata["policy"] = "kuai bf16 autocast, native bf16 (probabilities and ds rounded)"
    mg.write_safetensors(NATIVE_OUTPUT, out, metadata)
    print(f"wrote {NATIVE_OUTPUT} ({os.path.getsize(NATIVE_OUTPUT)} bytes, {len(out)} tensors)")


def main():
    torch.set_num_threads(1)  # one thread: a fixed reduction order
    c = mg.CONFIG
    src, src_meta = mg.read_safetensors(SOURCE)
    for k, v in c.items():
        assert src_meta[k] == str(v), f"{SOURCE} was written with {k}={src_meta[k]}, not {v}"
    if "--native-only" in sys.argv[1:]:
        names = [n[len("param."):] for n in src if n.startswith("param.")]
        write_native_emulation(src, c, names)
        return
    model = torch_gpt.GPT(c["vocab_size"], c["n_layer"], c["n_head"], c["d_model"], c["seq_len"])
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(src[f"param.{n}"])
    model64 = copy.deepcopy(model).double()
    idx, targets = src["idx"].long(), src["targets"].long()
    ig = c["ignore_index"]

    check_dtypes(model, idx, targets, ig)

    # fp32 without autocast must reproduce the fp32 fixture exactly (same weights, same batch).
    logits32, loss32, grads32 = forward_backward(model, idx, targets, ig, autocast=False)
    assert torch.equal(logits32, src["logits"]) and torch.equal(loss32, src["loss"])
    for n in names:
        assert torch.equal(grads32[n], src[f"grad.{n}"]), n

    logits16, loss16, grads16 = forward_backward(model, idx, targets, ig, autocast=True)
    assert logits16.dtype == torch.bfloat16
    logits64, loss64, grads64 = forward_backward(model64, idx, targets, ig, autocast=False)

    params = {n: src[f"param.{n}"] for n in names}
    exact = emulate(params, idx, targets, c, "none")  # the emulator is the model:
    assert rel(exact[0], logits64) < 1e-12 and rel(exact[1], loss64) < 1e-12
    assert all(rel(exact[2][n], grads64[n]) < 1e-12 for n in names)
    emu_torch = emulate(params, idx, targets, c, "torch")
    emu_kuai = emulate(params, idx, targets, c, "kuai")

    out = [("logits", logits16.float()), ("loss", loss16.float())]
    out += [(f"grad.{n}", grads16[n].float()) for n in names]
    out += [("f64.logits", logits64.float()), ("f64.loss", loss64.float())]
    out += [(f"f64.grad.{n}", grads64[n].float()) for n in names]
    out += [("emu.logits", emu_kuai[0].float()), ("emu.loss", emu_kuai[1].float())]
    out += [(f"emu.grad.{n}", emu_kuai[2][n].float()) for n in names]
    out += [("loss_fp32", loss32)]
    metadata = {k: str(v) for k, v in c.items()}
    metadata["torch_version"] = torch.__version__
    metadata["autocast"] = "cpu bfloat16"
    metadata["source"] = os.path.basename(SOURCE)
    mg.write_safetensors(OUTPUT, out, metadata)

    back, back_meta = mg.read_safetensors(OUTPUT)
    assert back_meta == metadata and list(back) == [n for n, _ in out]
    for n, t in out:
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n

    print(f"wrote {OUTPUT} ({os.path.getsize(OUTPUT)} bytes, {len(out)} tensors)")
    write_native_emulation(src, c, names)
    print(f"loss: torch-bf16 {loss16.item():.7f} fp32 {loss32.item():.7f} f64 {loss64.item():.7f}"
          f" emu-torch {emu_torch[1].item():.7f} emu-kuai {emu_kuai[1].item():.7f}")
    print("relative Frobenius distance to float64:")
    heads = ("torch-bf16", "torch-fp32", "emu-torch", "emu-kuai")
    print(f"{'tensor':30s} " + " ".join(f"{h:>11s}" for h in heads))
    rows = [("logits", logits16, logits32, emu_torch[0], emu_kuai[0], logits64)]
    rows += [(f"grad.{n}", grads16[n], grads32[n], emu_torch[2][n], emu_kuai[2][n], grads64[n])
             for n in names]
    for n, *ts, t64 in rows:
        print(f"{n:30s} " + " ".join(f"{rel(t, t64):11.3e}" for t in ts))

if __name__ == "__main__":
    main()
