#!/usr/bin/python3
"""What a training loop written in Python costs against the CLI's own loop: a benchmark.

Three arms train the same GPT-2 (same shape, batch, hyperparameters, seed, data and threads),
each in its own process so that no allocator or thread-pool state passes between them:

  cli      `build/kuai train`, its `RESULT ... step_ms_median=...` line.
  python   the built-in kuai.nn.GPT trained by a Python loop: kuai.data.DataLoader over the
           source the CLI reads, AdamW with the CLI's parameter groups (decay on the 2-D matmul
           weights only), the warmup-cosine schedule, kuai.nn.utils.clip_grad_norm_ (the loop of
           python/tests/test_train_equivalence.py, which equals the CLI bit for bit).
  pyblock  the same loop over a GPT written in Python from kuai's layers (PyBlock/PyGPT of that
           test), loaded with the built-in model's initial weights.

What is timed matches the CLI's step_ms (kuai/train/trainer.cpp): from before the batch is taken
from the loader to after zero_grad and the learning-rate update (the CLI sets the rate at the
start of its step, the Python loop at the end: the same work), with no host read of the loss
inside the window (each arm reads it after the step's clock stops). The median is over steps
2..N (the first step allocates the caches), as the CLI's. The final losses are printed too: the
cli and python arms should agree (same floats), pyblock as well (same ops).

One difference stays by default: the Python loop clips with nn.utils.clip_grad_norm_, which
scales every gradient in a pass of its own, where the CLI folds the clip factor into the AdamW
update. `--clip fused` makes the Python arms do what the CLI does (the factor passed to
optimizer.step(grad_scale)), to tell that pass apart from the loop's own cost.

Rounds alternate the arms' order (cli, python, pyblock, then pyblock, python, cli: ABBA), and the
table reports the median of the per-round medians with their min-max. Every arm runs with the same
OMP_NUM_THREADS (the CLI also gets --train.threads). Ratios are the figures to quote: these
machines are shared and noisy.

Shapes: "kjv" is configs/kjv.toml's model and batch on data/kjv.bin (its hyperparameters too);
"gpt2" is GPT-2 124M (V 50257, L 12, H 12, C 768, T 256, B 4) on synthetic tokens, same
hyperparameters.

Run (from the repository root, after `make build`):

    PYTHONPATH=build/python /usr/bin/python3 bench/python_loop.py \\
        [--shapes kjv,gpt2] [--steps N] [--rounds 4] [--threads $(nproc)] [--clip python|fused]

Ends with one line
    RESULT kjv_python_over_cli=<f> kjv_pyblock_over_python=<f> gpt2_python_over_cli=<f> ...
(ratios of median step times: above 1, the Python arm is slower).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ARMS = ("cli", "python", "pyblock")

# config.h's defaults, for keys the TOML file leaves out.
TRAIN_DEFAULTS = dict(batch_size=16, lr=1e-3, min_lr_ratio=0.1, warmup_steps=20,
                      weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, seed=1337)
DATA_DEFAULTS = dict(workers=2, prefetch_factor=2)

GPT2_124M = dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, seq_len=256)
DEFAULT_STEPS = {"kjv": 20, "gpt2": 6}


def load_shapes(config_path):
    """The shapes' full specifications: model, batch, hyperparameters, data source."""
    with open(config_path, "rb") as f:
        toml = tomllib.load(f)
    model = {k: toml["model"][k] for k in ("vocab_size", "n_layer", "n_head", "d_model", "seq_len")}
    train = {k: toml.get("train", {}).get(k, v) for k, v in TRAIN_DEFAULTS.items()}
    data = {k: toml.get("data", {}).get(k, v) for k, v in DATA_DEFAULTS.items()}
    path = toml.get("data", {}).get("path", "data/kjv.bin")
    kjv = dict(model=model, train=dict(train), data=dict(data, source="file",
                                                          path=os.path.join(ROOT, path)))
    gpt2 = dict(model=dict(GPT2_124M), train=dict(train, batch_size=4),
                data=dict(data, source="synthetic", path=""))
    return {"kjv": kjv, "gpt2": gpt2}


def flops_per_step(spec):
    """6·N·tokens plus causal attention (bench/peer_compare.py's count, tied lm_head counted)."""
    m = spec["model"]
    C, L, V, T = m["d_model"], m["n_layer"], m["vocab_size"], m["seq_len"]
    n = L * (12 * C * C + 13 * C) + 2 * C + V * C
    return spec["train"]["batch_size"] * T * (6 * n + 6 * L * T * C)


# ---------------------------------------------------------------- the Python arms (subprocess)

def python_arm(arm, spec, steps, attention, clip_mode):
    import kuai
    import kuai.nn as nn

    # The GPT written in Python from kuai's layers that python/tests/test_train_equivalence.py
    # trains to the CLI's losses bit for bit.
    sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
    from test_train_equivalence import PyGPT

    tr, dt = spec["train"], spec["data"]
    B, T = tr["batch_size"], spec["model"]["seq_len"]
    cfg = nn.GPTConfig(**spec["model"])
    model = nn.GPT(cfg, seed=tr["seed"])  # the CLI's initial weights
    if arm == "pyblock":
        builtin = model
        model = PyGPT(cfg)
        model.load_state_dict(builtin.state_dict())
        del builtin
    # The CLI applies kuai::optimize with its model.attention (build_step_parts).
    kuai.optimize(model, attention=attention)

    # The CLI's AdamW groups (kuai/train/step_parts.cpp param_groups).
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        matmul = (p.dim() == 2 and name.endswith(".weight")
                  and not name.startswith(("wte.", "wpe.", "embed_tokens.")))
        (decay if matmul else no_decay).append(p)
    opt = kuai.optim.AdamW([{"params": decay, "weight_decay": tr["weight_decay"]},
                            {"params": no_decay, "weight_decay": 0.0}],
                           lr=tr["lr"], betas=(tr["beta1"], tr["beta2"]))
    sched = kuai.optim.lr_scheduler.WarmupCosineLR(opt, tr["warmup_steps"], steps,
                                                   tr["min_lr_ratio"])
    if dt["source"] == "synthetic":
        source = kuai.data.SyntheticTokens(spec["model"]["vocab_size"], B, T, seed=tr["seed"])
    else:  # the CLI runs with data.val_fraction = 0: windows over the whole file
        source = kuai.data.RandomWindows(kuai.data.TokenFile(dt["path"]), B, T, seed=tr["seed"])
    loader = kuai.data.DataLoader(source, num_workers=dt["workers"],
                                  prefetch_factor=dt["prefetch_factor"])
    batches = iter(loader)
    params = model.parameters()
    clip = tr["grad_clip"]
    # --clip fused: the CLI's way (TrainStep::run): the norm's clip factor is folded into the
    # AdamW update (optimizer.step(grad_scale) multiplies the gradients inside its own pass),
    # with no separate pass that scales every gradient as clip_grad_norm_ does.
    fused = clip_mode == "fused" and clip > 0

    step_ms, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        loss = model(x, y)
        loss.backward()
        if fused:
            factor = nn.utils.clip_coefficient(nn.utils.grad_norm(params), clip)
            opt.step(factor)
        else:
            if clip > 0:
                nn.utils.clip_grad_norm_(params, clip)
            opt.step()
        opt.zero_grad()
        sched.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())  # after the clock stops: the CLI's logger reads it later
    timed = step_ms[1:] if len(step_ms) > 1 else step_ms
    print(f"RESULT step_ms_median={statistics.median(timed):.2f} final_loss={losses[-1]:.4f} "
          f"first_step_ms={step_ms[0]:.2f}", flush=True)


# ---------------------------------------------------------------- the driver

RESULT_RE = re.compile(r"^RESULT (.*)$", re.M)


def parse_result(text):
    m = RESULT_RE.findall(text)
    if not m:
        return None
    out = {}
    for kv in m[-1].split():
        k, _, v = kv.partition("=")
        try:
            out[k] = float(v)
        except ValueError:
            out[k] = v
    return out


def cli_command(kuai_bin, config, spec, steps, threads, attention, run_dir, run_name):
    tr, dt, md = spec["train"], spec["data"], spec["model"]
    o = [f"--model.{k}={v}" for k, v in md.items()]
    o += ["--model.family=gpt2", f"--model.attention={attention}"]
    o += [f"--train.{k}={tr[k]}" for k in TRAIN_DEFAULTS]
    o += [f"--train.steps={steps}", f"--train.threads={threads}", "--train.accum_steps=1",
          "--train.precision=fp32", "--train.compile=false", "--train.recompute=none",
          "--train.eval_every=0", "--train.offload=none"]
    o += [f"--data.source={dt['source']}", "--data.val_fraction=0",
          f"--data.workers={dt['workers']}", f"--data.prefetch_factor={dt['prefetch_factor']}",
          "--data.delay_ms=0"]
    if dt["source"] == "file":
        o.append(f"--data.path={dt['path']}")
    o += ["--log.progress=off", "--log.jsonl=false", "--log.tensorboard=false",
          "--log.sync_every_step=false", "--log.save_weights=false",
          "--checkpoint.save_every=0", "--checkpoint.export_every=0",
          f"--run.dir={run_dir}", f"--run.name={run_name}"]
    return [kuai_bin, "train", "--config", config] + o


def run_arm(arm, shape, spec, args, env, run_dir, tag):
    if arm == "cli":
        cmd = cli_command(args.kuai, args.config, spec, args.steps_of[shape], args.threads,
                          args.attention, run_dir, tag)
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--spec", json.dumps(spec),
               "--steps", str(args.steps_of[shape]), "--attention", args.attention,
               "--clip", args.clip]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    r = parse_result(p.stdout)
    if p.returncode != 0 or r is None or "step_ms_median" not in r:
        sys.stderr.write(f"{arm} on {shape} failed (exit {p.returncode}): {' '.join(cmd)}\n"
                         f"{p.stdout[-3000:]}{p.stderr[-3000:]}\n")
        sys.exit(1)
    return r


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def spread(vals):
    return f"{min(vals):.2f}-{max(vals):.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="kjv,gpt2", help="comma-separated: kjv, gpt2")
    ap.add_argument("--steps", type=int, default=0,
                    help="steps per run (median over 2..N); 0: kjv 20, gpt2 6")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the order alternates (ABBA)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kuai", default=os.path.join(ROOT, "build", "kuai"))
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "kjv.toml"),
                    help="the kjv shape's model, batch, hyperparameters and data")
    ap.add_argument("--attention", default="auto", choices=("naive", "flash", "auto"),
                    help="model.attention for every arm (the CLI's default: auto)")
    ap.add_argument("--clip", default="python", choices=("python", "fused"),
                    help="the Python arms' clipping: python = nn.utils.clip_grad_norm_ then "
                         "opt.step() (a user's loop); fused = the factor folded into the update, "
                         "as the CLI does (opt.step(grad_scale=clip_coefficient(grad_norm(params), max_norm)))")
    ap.add_argument("--json", default="", help="also write the table as JSON here")
    # Internal: one Python arm in this process.
    ap.add_argument("--arm", choices=("python", "pyblock"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.arm:
        python_arm(args.arm, json.loads(args.spec), args.steps, args.attention, args.clip)
        return

    all_shapes = load_shapes(args.config)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in all_shapes:
            ap.error(f"unknown shape '{s}' (known: {', '.join(all_shapes)})")
    args.steps_of = {s: args.steps or DEFAULT_STEPS[s] for s in shapes}

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    pp = os.path.join(ROOT, "build", "python")
    if pp not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(x for x in (pp, env.get("PYTHONPATH")) if x)

    print(f"bench/python_loop.py: {cpu_name()}, {os.cpu_count()} CPUs; threads {args.threads} "
          f"(OMP_NUM_THREADS, --train.threads); rounds {args.rounds} (ABBA over "
          f"{', '.join(ARMS)}); attention {args.attention}; Python arms' clipping {args.clip}; "
          f"fp32; step medians over steps 2..N")
    for s in shapes:
        sp = all_shapes[s]
        print(f"  {s}: model {sp['model']} batch {sp['train']['batch_size']}, "
              f"{args.steps_of[s]} steps, data {sp['data']['source']}"
              f"{' ' + os.path.relpath(sp['data']['path'], ROOT) if sp['data']['path'] else ''}, "
              f"{sp['data']['workers']} loader workers")
    sys.stdout.flush()

    table = {}
    with tempfile.TemporaryDirectory(prefix="kuai-python-loop-") as run_dir:
        for s in shapes:
            per = {a: [] for a in ARMS}
            loss = {a: [] for a in ARMS}
            for r in range(args.rounds):
                order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
                for a in order:
                    res = run_arm(a, s, all_shapes[s], args, env, run_dir, f"{s}-r{r}")
                    per[a].append(res["step_ms_median"])
                    loss[a].append(res["final_loss"])
                print(f"  {s} round {r + 1}: " + ", ".join(
                    f"{a} {per[a][-1]:.2f} ms (loss {loss[a][-1]:.4f})" for a in ARMS), flush=True)
            med = {a: statistics.median(per[a]) for a in ARMS}
            ratios_py = [p / c for p, c in zip(per["python"], per["cli"])]
            ratios_blk = [b / p for b, p in zip(per["pyblock"], per["python"])]
            table[s] = dict(
                step_ms={a: med[a] for a in ARMS},
                step_ms_rounds={a: per[a] for a in ARMS},
                final_loss={a: loss[a][-1] for a in ARMS},
                python_over_cli=med["python"] / med["cli"],
                python_over_cli_rounds=ratios_py,
                pyblock_over_python=med["pyblock"] / med["python"],
                pyblock_over_python_rounds=ratios_blk,
                cli_gflops=flops_per_step(all_shapes[s]) / (med["cli"] / 1e3) / 1e9,
            )

    print()
    print("| shape | CLI ms (min-max) | Python loop ms (min-max) | Python / CLI (min-max) "
          "| Python-block GPT ms (min-max) | Python-block / built-in (min-max) | CLI GFLOP/s "
          "| final loss cli / python / pyblock |")
    print("|---|---|---|---|---|---|---|---|")
    for s, t in table.items():
        ms, rd = t["step_ms"], t["step_ms_rounds"]
        fl = t["final_loss"]
        print(f"| {s} | {ms['cli']:.2f} ({spread(rd['cli'])}) "
              f"| {ms['python']:.2f} ({spread(rd['python'])}) "
              f"| {t['python_over_cli']:.3f} ({spread(t['python_over_cli_rounds'])}) "
              f"| {ms['pyblock']:.2f} ({spread(rd['pyblock'])}) "
              f"| {t['pyblock_over_python']:.3f} ({spread(t['pyblock_over_python_rounds'])}) "
              f"| {t['cli_gflops']:.1f} "
              f"| {fl['cli']:.4f} / {fl['python']:.4f} / {fl['pyblock']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, rounds=args.rounds, steps=args.steps_of,
                           attention=args.attention, clip=args.clip, cpu=cpu_name(),
                           shapes=table), f, indent=1)
    print("RESULT " + " ".join(
        f"{s}_python_over_cli={t['python_over_cli']:.3f} "
        f"{s}_pyblock_over_python={t['pyblock_over_python']:.3f} "
        f"{s}_cli_step_ms={t['step_ms']['cli']:.2f}" for s, t in table.items()))


if __name__ == "__main__":
    main()
