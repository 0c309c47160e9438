#!/usr/bin/python3
"""The PyTorch peer of kuai's GPT: the same model, trained on synthetic tokens, timed per step.

This file is the one PyTorch definition of the model. It is imported by
tests/golden/make_golden.py (which writes the golden fixture the C++ tests compare against) and
run as a benchmark by bench/peer_compare.py. Run it with Debian's torch:

    /usr/bin/python3 bench/peers/torch_gpt.py --threads 2 --steps 6

The model is GPT-2 style: token embedding wte (V, C) and learned positions wpe (seq_len, C);
n_layer pre-LayerNorm blocks x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)); a final ln_f; and
logits = ln_f(x) @ wte.weight^T (the lm_head is tied to wte and has no bias). Parameter names
and their order (named_parameters()) are the contract with kuai's nn::GPT:

    wte.weight, wpe.weight,
    h.{i}.ln_1.weight, h.{i}.ln_1.bias, h.{i}.attn.c_attn.weight, h.{i}.attn.c_attn.bias,
    h.{i}.attn.c_proj.weight, h.{i}.attn.c_proj.bias, h.{i}.ln_2.weight, h.{i}.ln_2.bias,
    h.{i}.mlp.c_fc.weight, h.{i}.mlp.c_fc.bias, h.{i}.mlp.c_proj.weight, h.{i}.mlp.c_proj.bias,
    ln_f.weight, ln_f.bias

Linear weights are in torch layout (out_features, in_features).

At the end the benchmark prints exactly one line
    RESULT tokens_per_s=<f> step_ms_median=<f> peak_rss_mib=<f> final_loss=<f>
where the median step time excludes the first (warm-up) step. --precision bf16 runs the
forward and the loss under torch.autocast("cpu", dtype=torch.bfloat16) (backward outside it, as
PyTorch recommends); CPU autocast has no fp16 mode in this torch, and bf16 needs no GradScaler.
"""

import argparse
import math
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYERNORM_EPS = 1e-5
INIT_STD = 0.02
# Parameters whose names end in these get weight decay; all others (embeddings, biases,
# LayerNorm) get none.
DECAYED_SUFFIXES = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        assert d_model % n_head == 0, "d_model must be divisible by n_head"
        self.n_head = n_head
        self.c_attn = nn.Linear(d_model, 3 * d_model)  # -> q, k, v in that order
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=LAYERNORM_EPS)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln_2 = nn.LayerNorm(d_model, eps=LAYERNORM_EPS)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 style language model with a tied, bias-free lm_head."""

    def __init__(self, vocab_size, n_layer, n_head, d_model, seq_len):
        super().__init__()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model, eps=LAYERNORM_EPS)
        self.init_gpt2(n_layer)

    @torch.no_grad()
    def init_gpt2(self, n_layer):
        """GPT-2 init: N(0, 0.02) weights and embeddings, residual projections scaled by
        1/sqrt(2 * n_layer), zero biases, LayerNorm weight 1 and bias 0. Draws from torch's
        global RNG in named_parameters() order."""
        proj_std = INIT_STD / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if ".ln_" in name or name.startswith("ln_f."):
                p.fill_(1.0 if name.endswith(".weight") else 0.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight"):
                p.normal_(0.0, proj_std)
            else:
                p.normal_(0.0, INIT_STD)

    def forward(self, idx):
        """idx (B, T) int64 with T <= seq_len -> logits (B, T, V)."""
        B, T = idx.shape
        assert T <= self.seq_len, f"sequence length {T} exceeds seq_len {self.seq_len}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return F.linear(x, self.wte.weight)  # (B, T, V), tied lm_head


def loss_fn(logits, targets, ignore_index=-1):
    """Mean cross-entropy over the positions whose target is not ignore_index."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index
    )


def param_groups(model, weight_decay, decayed=DECAYED_SUFFIXES):
    """AdamW groups: parameters whose names end in `decayed` (the matmul weights) decayed,
    everything else not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if name.endswith(decayed) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model, lr, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                   decayed=DECAYED_SUFFIXES):
    return torch.optim.AdamW(param_groups(model, weight_decay, decayed), lr=lr, betas=betas,
                             eps=eps)


def peer_arg_parser(description):
    """The options both peers take (shape, run, precision); a peer adds its model's own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--vocab_size", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: forward and loss under torch.autocast('cpu', dtype=torch.bfloat16)")
    return p


def parse_peer_args(p, argv):
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the first step is warm-up)")
    return args


def parse_args(argv):
    return parse_peer_args(peer_arg_parser("PyTorch GPT peer benchmark (synthetic tokens)."), argv)


def train_and_report(model, optimizer, args):
    """The timed loop both peers run: args.steps AdamW steps (clipped at 1.0) on new uniform
    random tokens each step, then the RESULT line; the median excludes the first step."""
    model.train()
    params = list(model.parameters())
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    B, T = args.batch_size, args.seq_len

    step_seconds = []
    loss_value = float("nan")
    for step in range(args.steps):
        # A new batch of uniform random tokens each step: inputs and next-token targets.
        tokens = torch.randint(0, args.vocab_size, (B, T + 1), generator=data_gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        dt = time.perf_counter() - t0
        loss_value = loss.item()
        step_seconds.append(dt)
        print(f"step {step} loss {loss_value:.6f} ms {dt * 1e3:.3f}", flush=True)

    median_s = statistics.median(step_seconds[1:])
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(
        f"RESULT tokens_per_s={B * T / median_s:.3f} step_ms_median={median_s * 1e3:.3f} "
        f"peak_rss_mib={peak_rss_mib:.3f} final_loss={loss_value:.6f}",
        flush=True,
    )


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = GPT(args.vocab_size, args.n_layer, args.n_head, args.d_model, args.seq_len)
    train_and_report(model, make_optimizer(model, args.lr), args)


if __name__ == "__main__":
    main(sys.argv[1:])
