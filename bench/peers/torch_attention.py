#!/usr/bin/python3
"""PyTorch's naive causal attention, forward + backward, timed: the peer of `kuai bench attention`.

    /usr/bin/python3 bench/peers/torch_attention.py --T 2048 --dtype fp32 --threads 2 --reps 3

The attention is the one of torch_gpt.py's CausalSelfAttention: q, k, v are (B, H, T, d) views of
one (B, T, 3*H*d) leaf (as a qkv projection makes them), then q @ k^T * scale, masked_fill with
-inf above the diagonal, softmax, @ v; backward from a fixed output gradient. --dtype bf16 runs
the forward under torch.autocast("cpu", dtype=torch.bfloat16), as torch_gpt.py does.

Run it once per T: the peak resident set is then this T's. It prints one line
    RESULT T=<int> dtype=<str> ms_median=<float> extra_mib=<float>
ms_median: median of --reps timed forward+backward passes after one warm-up pass. extra_mib: the
peak resident set (VmHWM) over those passes minus the resident set with the inputs allocated,
i.e. the memory the attention itself needs (its saved T x T matrices, the gradients).
"""

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def rss_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(field + " not in /proc/self/status")


def attention(qkv, B, T, H, d):
    q, k, v = qkv.split(H * d, dim=2)
    q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (B, H, T, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    att = att.masked_fill(~mask, float("-inf"))
    att = F.softmax(att, dim=-1)
    return att @ v  # (B, H, T, d)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, T, H, d = a.batch, a.T, a.heads, a.head_dim
    qkv = torch.randn(B, T, 3 * H * d, requires_grad=True)
    dy = torch.randn(B, H, T, d)
    base = rss_mib("VmRSS")
    times = []
    for i in range(a.reps + 1):
        qkv.grad = None
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            y = attention(qkv, B, T, H, d)
        y.backward(dy.to(y.dtype))
        dt = time.perf_counter() - t0
        del y
        if i > 0:
            times.append(dt)
    extra = rss_mib("VmHWM") - base
    print(f"RESULT T={T} dtype={a.dtype} ms_median={statistics.median(times) * 1e3:.3f} "
          f"extra_mib={extra:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
