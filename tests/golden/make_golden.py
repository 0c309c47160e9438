#!/usr/bin/python3
"""Writes tests/golden/tiny_gpt.safetensors, the PyTorch reference a tiny GPT must match.

Run by hand with Debian's torch (CI never runs it; the fixture is committed):

    /usr/bin/python3 tests/golden/make_golden.py

The model is the one in bench/peers/torch_gpt.py. The fixture holds, all little-endian:
    param.<name>   F32   initial parameters (GPT-2 init, then LayerNorm weights/biases and
                         Linear biases perturbed by N(0, 0.1) so they are exercised)
    idx            I32   (B, T) input tokens
    targets        I32   (B, T) target tokens; two positions are -1 (ignore_index)
    logits         F32   (B, T, V) of the first forward
    loss           F32   [1]  mean cross-entropy over the non-ignored positions
    grad.<name>    F32   gradients of that first forward/backward
    losses         F32   [3]  loss of each of 3 training steps on the same batch, before its update
    gradnorm       F32   [3]  total gradient norm returned by clip_grad_norm_(params, 1.0)
    step3.<name>   F32   parameters after the 3 AdamW steps
and __metadata__ with the configuration as strings. The safetensors writer and reader here
are deliberately minimal (json + struct); the script reads the file back and checks every
value bit for bit before it finishes.
"""

import copy
import json
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "peers"))

import torch_gpt  # noqa: E402  (the one PyTorch model definition)

CONFIG = {
    "vocab_size": 67,
    "n_layer": 2,
    "n_head": 2,
    "d_model": 32,
    "seq_len": 16,
    "batch": 3,
    "T": 11,
    "lr": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-6,
    "weight_decay": 0.1,
    "grad_clip": 0.8,
    "ignore_index": -1,
    "seed": 1234,
}
TRAIN_STEPS = 3
PERTURB_STD = 0.1
# (batch, position) pairs whose target is set to ignore_index.
IGNORED_POSITIONS = ((0, 3), (2, 10))
OUTPUT = os.path.join(HERE, "tiny_gpt.safetensors")

DTYPES = {
    torch.float64: ("F64", "<d", 8),
    torch.float32: ("F32", "<f", 4),
    torch.int32: ("I32", "<i", 4),
}
DTYPE_BY_NAME = {name: (dtype, fmt, size) for dtype, (name, fmt, size) in DTYPES.items()}


def tensor_bytes(t):
    fmt = DTYPES[t.dtype][1]
    values = t.detach().contiguous().reshape(-1).tolist()
    return struct.pack(f"<{len(values)}{fmt[1]}", *values)


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, torch tensor), written back to back in this order."""
    header = {"__metadata__": dict(metadata)}
    blobs = []
    offset = 0
    for name, t in tensors:
        blob = tensor_bytes(t)
        header[name] = {
            "dtype": DTYPES[t.dtype][0],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_safetensors(path):
    """Returns ({name: torch tensor}, metadata), checking the layout as it goes."""
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) >= 8, "truncated file"
    (n,) = struct.unpack("<Q", raw[:8])
    assert n <= len(raw) - 8, "header length exceeds file size"
    header = json.loads(raw[8 : 8 + n].decode("utf-8"))
    data = raw[8 + n :]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    end_prev = 0
    for name, entry in header.items():
        torch_dtype, fmt, size = DTYPE_BY_NAME[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = 1
        for d in entry["shape"]:
            count *= d
        assert begin == end_prev and end - begin == count * size and end <= len(data), name
        end_prev = end
        values = struct.unpack(f"<{count}{fmt[1]}", data[begin:end])
        tensors[name] = torch.tensor(values, dtype=torch_dtype).reshape(entry["shape"])
    assert end_prev == len(data), "trailing bytes after the last tensor"
    return tensors, metadata


def main():
    torch.set_num_threads(1)  # one thread: a fixed reduction order
    c = CONFIG
    torch.manual_seed(c["seed"])
    model = torch_gpt.GPT(c["vocab_size"], c["n_layer"], c["n_head"], c["d_model"], c["seq_len"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_layernorm = ".ln_" in name or name.startswith("ln_f.")
            if is_layernorm or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * PERTURB_STD)
    names = [name for name, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    # The same model in float64: the oracle both fp32 implementations are measured against.
    model64 = copy.deepcopy(model).double()

    B, T, V = c["batch"], c["T"], c["vocab_size"]
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    for b, t in IGNORED_POSITIONS:
        targets[b, t] = c["ignore_index"]

    out = [(f"param.{n}", p.detach().clone()) for n, p in zip(names, params)]
    out += [("idx", idx.to(torch.int32)), ("targets", targets.to(torch.int32))]

    # The first forward/backward: logits, loss, gradients.
    logits = model(idx)
    loss = torch_gpt.loss_fn(logits, targets, c["ignore_index"])
    loss.backward()
    out += [("logits", logits.detach().clone()), ("loss", loss.detach().reshape(1).clone())]
    out += [(f"grad.{n}", p.grad.detach().clone()) for n, p in zip(names, params)]

    # Three AdamW steps on the same batch.
    optimizer = torch_gpt.make_optimizer(
        model, c["lr"], weight_decay=c["weight_decay"], betas=(c["beta1"], c["beta2"]), eps=c["eps"]
    )
    losses, gradnorms = [], []
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = torch_gpt.loss_fn(model(idx), targets, c["ignore_index"])
        loss.backward()
        gradnorms.append(torch.nn.utils.clip_grad_norm_(params, c["grad_clip"]).item())
        optimizer.step()
        losses.append(loss.item())
    out += [("losses", torch.tensor(losses)), ("gradnorm", torch.tensor(gradnorms))]
    out += [(f"step3.{n}", p.detach().clone()) for n, p in zip(names, params)]

    # The same three steps in float64 (tests compare kuai's and PyTorch's fp32 errors against it).
    optimizer64 = torch_gpt.make_optimizer(
        model64, c["lr"], weight_decay=c["weight_decay"], betas=(c["beta1"], c["beta2"]), eps=c["eps"]
    )
    params64 = list(model64.parameters())
    for _ in range(TRAIN_STEPS):
        optimizer64.zero_grad(set_to_none=True)
        loss64 = torch_gpt.loss_fn(model64(idx), targets, c["ignore_index"])
        loss64.backward()
        torch.nn.utils.clip_grad_norm_(params64, c["grad_clip"])
        optimizer64.step()
    out += [(f"step3_f64.{n}", p.detach().clone()) for n, p in zip(names, params64)]

    metadata = {k: str(v) for k, v in c.items()}
    metadata["torch_version"] = torch.__version__
    write_safetensors(OUTPUT, out, metadata)

    # Read it back with our own reader and compare every value bit for bit.
    back, back_meta = read_safetensors(OUTPUT)
    assert back_meta == metadata, "metadata mismatch"
    assert list(back) == [name for name, _ in out], "tensor names or order mismatch"
    for name, t in out:
        r = back[name]
        assert r.dtype == t.dtype and r.shape == t.shape, name
        assert torch.equal(r, t), f"value mismatch in {name}"

    print(f"wrote {OUTPUT} ({os.path.getsize(OUTPUT)} bytes, {len(out)} tensors)")
    print(f"loss {dict(out)['loss'].item():.6f} losses {losses} gradnorm {gradnorms}")


if __name__ == "__main__":
    main()
