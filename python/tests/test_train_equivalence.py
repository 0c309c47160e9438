"""A GPT trained from Python equals the CLI's training of the same config, bit for bit: the
built-in GPT through a Python loop, and a GPT written in Python from kuai's layers, each for 20
steps of AdamW with the warmup-cosine schedule, global-norm clipping and weight decay on the
matmul weights (the CLI's groups)."""

import json
import os
import subprocess

import kuai
import kuai.nn as nn

STEPS = 20
CFG = dict(vocab_size=256, n_layer=2, n_head=2, d_model=64, seq_len=32)
TRAIN = dict(batch_size=4, lr=2e-3, warmup_steps=5, weight_decay=0.1, grad_clip=1.0, seed=1337,
             beta1=0.9, beta2=0.95, min_lr_ratio=0.1)


def cli_losses(kuai_bin, corpus, tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[model]\n" + "".join(f"{k} = {v}\n" for k, v in CFG.items())
        + "[train]\n" + "".join(f"{k} = {v}\n" for k, v in TRAIN.items())
        + f"steps = {STEPS}\nlog_every = 1\neval_every = 0\nthreads = {os.cpu_count()}\n"
        + f'[data]\nsource = "file"\npath = "{corpus}"\nval_fraction = 0.0\nworkers = 0\n'
        + '[log]\nprogress = "off"\njsonl = true\ntensorboard = false\nsave_weights = false\n'
        + f'[run]\nname = "eq"\ndir = "{tmp_path}"\n'
    )
    subprocess.run([kuai_bin, "train", "--config", str(toml)], check=True,
                   stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count())))
    rows = [json.loads(line) for line in (tmp_path / "eq" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def groups(model):
    """The CLI's AdamW groups: decay on 2-D matmul weights, none on embeddings, norms, biases."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        matmul = (p.dim() == 2 and name.endswith(".weight")
                  and not name.startswith(("wte.", "wpe.", "embed_tokens.")))
        (decay if matmul else no_decay).append(p)
    return [{"params": decay, "weight_decay": TRAIN["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0}]


def python_losses(model, corpus, loss_fn):
    opt = kuai.optim.AdamW(groups(model), lr=TRAIN["lr"], betas=(TRAIN["beta1"], TRAIN["beta2"]))
    sched = kuai.optim.lr_scheduler.WarmupCosineLR(opt, TRAIN["warmup_steps"], STEPS,
                                                   TRAIN["min_lr_ratio"])
    source = kuai.data.RandomWindows(kuai.data.TokenFile(corpus), TRAIN["batch_size"],
                                     CFG["seq_len"], seed=TRAIN["seed"])
    loader = kuai.data.DataLoader(source, num_workers=2)
    losses = []
    for step, (x, y) in zip(range(STEPS), loader):
        loss = loss_fn(x, y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"])
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


class PyBlock(nn.Module):
    """GPT-2's block written in Python from kuai's layers (pre-LN, residual adds)."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = nn.CausalSelfAttention(cfg.d_model, cfg.n_head)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.MLP(cfg.d_model)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PyGPT(nn.Module):
    """GPT-2 written in Python: embeddings, blocks, final LayerNorm, head tied to wte."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.h = nn.ModuleList([PyBlock(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(kuai.arange(T))
        for block in self.h:
            x = block(x)
        logits = nn.functional.linear(self.ln_f(x), self.wte.weight)
        return nn.functional.cross_entropy(logits.view(-1, self.cfg.vocab_size), targets.view(-1))


def test_builtin_gpt_from_python_equals_cli(kuai_bin, corpus, tmp_path):
    expected = cli_losses(kuai_bin, corpus, tmp_path)
    assert len(expected) == STEPS
    model = nn.GPT(nn.GPTConfig(**CFG), seed=TRAIN["seed"])
    got = python_losses(model, corpus, lambda x, y: model(x, y))
    assert got == expected  # bit for bit: the same floats
    assert got[-1] < got[0]


def test_python_defined_gpt_equals_cli(kuai_bin, corpus, tmp_path):
    expected = cli_losses(kuai_bin, corpus, tmp_path)
    cfg = nn.GPTConfig(**CFG)
    model = PyGPT(cfg)
    builtin = nn.GPT(cfg, seed=TRAIN["seed"])  # the CLI's initial weights
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in builtin.named_parameters()]
    model.load_state_dict(builtin.state_dict())
    got = python_losses(model, corpus, lambda x, y: model(x, y))
    assert got == expected
