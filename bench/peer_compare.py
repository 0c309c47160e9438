#!/usr/bin/python3
"""A/B benchmark of kuai against the PyTorch peers on this machine: bench/peers/torch_gpt.py for
the GPT configurations, bench/peers/torch_llama.py for the LLaMA ones (family "llama").

Run by `make bench-peer`, i.e.

    /usr/bin/python3 bench/peer_compare.py --kuai build/kuai [--configs tiny,gpt2,llama]
        [--precision bf16] [--rounds 2] [--steps N] [--out build/bench_peer.json]

A LLaMA configuration runs kuai with `--model.family=llama --model.n_kv_head=<n>` and the peer
with `--n_kv_head=<n>`; both use their defaults for the rest: the MLP width
256 * ceil(int(8 * C / 3) / 256), untied embeddings, rope_theta 10000, RMSNorm eps 1e-5.

For each configuration the two trainers run alternately (kuai, torch, kuai, torch, ...) so that
machine noise hits both alike; each run prints a final line
    RESULT tokens_per_s=<f> step_ms_median=<f> peak_rss_mib=<f> final_loss=<f>
and the table reports medians over rounds. Both run with 2 threads; torch additionally with
OMP_WAIT_POLICY=PASSIVE. `<kuai> bench gemm` supplies the measured fp32 GEMM ceiling (`RESULT
gemm_gflops=<f>`) before the runs and again after each configuration's; a configuration's share
of the ceiling is against the higher of the two readings around its runs (on a shared host the
ceiling moves by a third within an hour, and a share against a reading taken minutes away says
more about the neighbours than about the trainers). /proc/cpuinfo gives the theoretical fp32
peak. Achieved model GFLOP/s are reported against both. The table is also written as JSON.
"""

import argparse
import json
import os
import statistics
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PEERS = {
    "gpt": os.path.join(HERE, "peers", "torch_gpt.py"),
    "llama": os.path.join(HERE, "peers", "torch_llama.py"),
}
TORCH_PYTHON = "/usr/bin/python3"  # Debian's python3-torch lives only under this interpreter
THREADS = 2

CONFIGS = {
    "tiny": dict(vocab_size=256, n_layer=4, n_head=4, d_model=256, seq_len=256, batch_size=16,
                 steps=6),
    "gpt2": dict(vocab_size=50257, n_layer=12, n_head=12, d_model=768, seq_len=256, batch_size=4,
                 steps=4),
    # Other shapes, not run by default: a mid-size model with a BPE-sized vocabulary, and a
    # narrow, deep one with long sequences.
    "mid": dict(vocab_size=8192, n_layer=6, n_head=8, d_model=512, seq_len=256, batch_size=8,
                steps=5),
    "deep": dict(vocab_size=256, n_layer=8, n_head=4, d_model=128, seq_len=512, batch_size=8,
                 steps=6),
    # LLaMA (RMSNorm, rotary positions, SwiGLU MLP, untied lm_head) at GPT-2's width and depth,
    # with grouped-query attention (3 query heads per kv head); F = 2048 by LLaMA's rule.
    "llama": dict(family="llama", vocab_size=256, n_layer=12, n_head=12, n_kv_head=4,
                  d_model=768, seq_len=256, batch_size=4, steps=4),
    # Not run by default: a mid-size LLaMA with 4 query heads per kv head (F = 1536).
    "llama-mid": dict(family="llama", vocab_size=256, n_layer=6, n_head=8, n_kv_head=2,
                      d_model=512, seq_len=256, batch_size=8, steps=5),
}
DEFAULT_CONFIGS = "tiny,gpt2,llama"
# KUAI_MAX_ISA tier -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) for the peer.
PEER_CAPS = {
    "baseline": ("default", "SSE41"),
    "avx2": ("avx2", "AVX2"),
    "avx512": ("avx512", "AVX512_CORE"),
    "avx512_bf16": ("avx512", "AVX512_CORE_BF16"),
    "amx": ("avx512", "AVX512_CORE_AMX"),
}
RESULT_KEYS = ("tokens_per_s", "step_ms_median", "peak_rss_mib", "final_loss")

FLOPS_FORMULA = (
    "FLOPs/step = B*T * (6*N + 6*L*T*C), "
    "N = L*(12*C^2 + 13*C) + 2*C + V*C (non-embedding params + tied lm_head matmul); "
    "6*L*T*C = causal attention QK^T and PV, fwd+bwd; "
    "llama: N = L*(2*C^2 + 2*C*Ckv + 3*C*F + 2*C) + C + V*C, Ckv = C*Hkv/H"
)


def family(cfg):
    return cfg.get("family", "gpt")


def llama_ffn_hidden(d_model):
    """LLaMA's default MLP width (torch_llama.default_ffn_hidden, kuai's default too)."""
    return 256 * ((int(2 * 4 * d_model / 3) + 255) // 256)


def non_embedding_params_with_lm_head(cfg):
    """Parameters that take part in matmuls per token: the blocks, the final norm, and the
    lm_head (V*C; GPT's is tied and counted again as a matmul although it shares wte's storage).
    Embedding (and GPT's wpe) lookups are gathers and are not counted."""
    C, L, V = cfg["d_model"], cfg["n_layer"], cfg["vocab_size"]
    if family(cfg) == "llama":
        c_kv = C * cfg["n_kv_head"] // cfg["n_head"]
        f = llama_ffn_hidden(C)
        per_layer = 2 * C * C + 2 * C * c_kv + 3 * C * f + 2 * C  # q, o; k, v; MLP; 2 norms
        return L * per_layer + C + V * C
    per_layer = (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C) + 4 * C
    return L * per_layer + 2 * C + V * C


def flops_per_step(cfg):
    # Training FLOPs of one step. Dense part: 6 per parameter per token (2 forward, 4 backward).
    # Attention scores and mixing, per token per layer: forward QK^T is 2*T*C FLOPs and PV another
    # 2*T*C when the full T x T square is computed (4*T*C); forward + backward is 3x that
    # (12*T*C); a causal mask halves the useful work: 6*T*C per token per layer, so 6*L*T*C.
    # (The same for LLaMA: grouped-query attention shares k and v but not the FLOPs.)
    T, C, L = cfg["seq_len"], cfg["d_model"], cfg["n_layer"]
    tokens = cfg["batch_size"] * T
    n = non_embedding_params_with_lm_head(cfg)
    return tokens * (6 * n + 6 * L * T * C)


def read_cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return set(), None, None
    flags, mhz, model = set(), None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "cpu MHz":
            try:
                mhz = max(mhz or 0.0, float(value))
            except ValueError:
                pass
        elif key == "model name" and model is None:
            model = value
    return flags, mhz, model


def theoretical_peak(threads):
    """fp32 peak GFLOP/s of the cores we use, and a sentence stating the assumptions."""
    flags, mhz, model = read_cpuinfo()
    cores = min(os.cpu_count() or 1, threads)
    if "avx512f" in flags:
        per_cycle, isa = 64, "AVX-512: 2 FMA x 16 fp32 x 2"
    elif "avx2" in flags and "fma" in flags:
        per_cycle, isa = 32, "AVX2+FMA: 2 FMA x 8 fp32 x 2"
    else:
        per_cycle, isa = 8, "no AVX2/FMA: assumed 8"
    if mhz is None:
        return None, f"{model or 'unknown CPU'}: no 'cpu MHz' in /proc/cpuinfo, peak n/a"
    peak = cores * per_cycle * mhz / 1e3
    note = (
        f"{model or 'unknown CPU'}: peak = {cores} cores x {per_cycle} FLOP/cycle ({isa}) x "
        f"{mhz / 1e3:.3f} GHz (/proc/cpuinfo 'cpu MHz', max over cores; turbo not modelled) "
        f"= {peak:.1f} GFLOP/s fp32"
    )
    return peak, note


def parse_result(stdout, prefix="RESULT"):
    """key=value pairs of the last line that starts with RESULT, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    if not lines:
        return None
    out = {}
    for item in lines[-1].split()[1:]:
        key, sep, value = item.partition("=")
        if sep:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out


def run(cmd, env_extra, timeout, required=RESULT_KEYS):
    """Runs cmd; returns (RESULT dict or None, error text or None, wall seconds)."""
    env = dict(os.environ)
    env.update(env_extra)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        return None, f"cannot run {cmd[0]}: {e}", 0.0
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s", timeout
    wall = time.perf_counter() - t0
    result = parse_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        return None, f"exit code {proc.returncode}, no usable RESULT line:\n{tail}", wall
    missing = [k for k in required if not isinstance(result.get(k), float)]
    if missing:
        return None, f"RESULT line lacks {', '.join(missing)}", wall
    return result, None, wall


def kuai_command(kuai, cfg, steps, precision="fp32"):
    cmd = [
        kuai, "train", "--data.source=synthetic",
        f"--model.vocab_size={cfg['vocab_size']}", f"--model.n_layer={cfg['n_layer']}",
        f"--model.n_head={cfg['n_head']}", f"--model.d_model={cfg['d_model']}",
        f"--model.seq_len={cfg['seq_len']}", f"--train.batch_size={cfg['batch_size']}",
        f"--train.steps={steps}", f"--train.threads={THREADS}",
        f"--train.precision={precision}",
    ]  # fmt: skip
    if family(cfg) == "llama":
        cmd += ["--model.family=llama", f"--model.n_kv_head={cfg['n_kv_head']}"]
    return cmd


def torch_command(cfg, steps, precision="fp32"):
    cmd = [
        TORCH_PYTHON, TORCH_PEERS[family(cfg)],
        f"--vocab_size={cfg['vocab_size']}", f"--n_layer={cfg['n_layer']}",
        f"--n_head={cfg['n_head']}", f"--d_model={cfg['d_model']}",
        f"--seq_len={cfg['seq_len']}", f"--batch_size={cfg['batch_size']}",
        f"--steps={steps}", f"--threads={THREADS}", f"--precision={precision}",
    ]  # fmt: skip
    if family(cfg) == "llama":
        cmd.append(f"--n_kv_head={cfg['n_kv_head']}")
    return cmd


def measure_gemm(kuai, timeout):
    env = {"OMP_NUM_THREADS": str(THREADS)}
    result, error, _ = run([kuai, "bench", "gemm"], env, timeout, required=("gemm_gflops",))
    return (None, error) if error else (result["gemm_gflops"], None)


def median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(value, digits=1, suffix=""):
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}{suffix}"


def summarize(runs, cfg, peak, gemm):
    """Medians over rounds of one trainer's runs, plus achieved FLOP rates."""
    ok = [r for r in runs if r is not None]
    s = {k: median_or_none([r[k] for r in ok]) for k in RESULT_KEYS}
    s["runs_ok"] = len(ok)
    tps = [r["tokens_per_s"] for r in ok]
    s["tokens_per_s_min"] = min(tps) if tps else None
    s["tokens_per_s_max"] = max(tps) if tps else None
    step_s = s["step_ms_median"] / 1e3 if s["step_ms_median"] else None
    s["gflops"] = flops_per_step(cfg) / step_s / 1e9 if step_s else None
    s["share_of_peak"] = ratio(s["gflops"], peak)
    s["share_of_gemm"] = ratio(s["gflops"], gemm)
    return s


def print_table(name, cfg, k, t, steps, rounds):
    shape = f"H={cfg['n_head']}"
    if family(cfg) == "llama":
        f = llama_ffn_hidden(cfg["d_model"])
        shape = f"llama H={cfg['n_head']} Hkv={cfg['n_kv_head']} F={f}"
    print(
        f"\n== {name}: V={cfg['vocab_size']} L={cfg['n_layer']} {shape} "
        f"C={cfg['d_model']} T={cfg['seq_len']} B={cfg['batch_size']}, {steps} steps/run "
        f"(median excludes step 0), {rounds} rounds ABBA, {THREADS} threads"
    )
    print(
        f"   N(non-embedding + lm_head) = {non_embedding_params_with_lm_head(cfg):,}  "
        f"FLOPs/step = {flops_per_step(cfg) / 1e9:,.2f} GFLOP"
    )
    rows = [
        ("tokens/s (median)", fmt(k["tokens_per_s"]), fmt(t["tokens_per_s"]),
         fmt(ratio(k["tokens_per_s"], t["tokens_per_s"]), 3, "x")),
        ("tokens/s (min-max)", spread(k), spread(t), within_noise(k, t)),
        ("step ms (median)", fmt(k["step_ms_median"]), fmt(t["step_ms_median"]),
         fmt(ratio(k["step_ms_median"], t["step_ms_median"]), 3, "x")),
        ("peak RSS MiB", fmt(k["peak_rss_mib"]), fmt(t["peak_rss_mib"]),
         fmt(ratio(k["peak_rss_mib"], t["peak_rss_mib"]), 3, "x")),
        ("model GFLOP/s", fmt(k["gflops"], 2), fmt(t["gflops"], 2),
         fmt(ratio(k["gflops"], t["gflops"]), 3, "x")),
        ("share of fp32 peak", fmt(pct(k["share_of_peak"]), 1, "%"),
         fmt(pct(t["share_of_peak"]), 1, "%"), ""),
        ("share of GEMM ceiling", fmt(pct(k["share_of_gemm"]), 1, "%"),
         fmt(pct(t["share_of_gemm"]), 1, "%"), ""),
        ("final loss (median)", fmt(k["final_loss"], 4), fmt(t["final_loss"], 4), ""),
        ("runs ok", str(k["runs_ok"]), str(t["runs_ok"]), ""),
    ]  # fmt: skip
    print(f"   {'':24}{'kuai':>14}{'torch':>14}{'kuai/torch':>12}")
    for label, a, b, r in rows:
        print(f"   {label:24}{a:>14}{b:>14}{r:>12}")


def spread(s):
    if s["tokens_per_s_min"] is None:
        return "n/a"
    return f"{s['tokens_per_s_min']:,.0f}-{s['tokens_per_s_max']:,.0f}"


def within_noise(k, t):
    """'within noise' when the two trainers' ranges over rounds overlap."""
    if k["tokens_per_s_min"] is None or t["tokens_per_s_min"] is None:
        return ""
    overlap = (k["tokens_per_s_min"] <= t["tokens_per_s_max"]
               and t["tokens_per_s_min"] <= k["tokens_per_s_max"])
    return "within noise" if overlap else ""


def pct(x):
    return None if x is None else 100.0 * x


def parse_args(argv):
    p = argparse.ArgumentParser(description="A/B benchmark: kuai vs the PyTorch peer.")
    p.add_argument("--kuai", required=True, help="path to the kuai binary (e.g. build/kuai)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma list of: {','.join(CONFIGS)} (default {DEFAULT_CONFIGS})")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per config")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per run (default: each config's, e.g. 6 for tiny, 4 for gpt2)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="both engines train in this precision (bf16: autocast)")
    p.add_argument("--out", default=None, help="JSON output (default: build/bench_peer.json)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"unknown config(s) {', '.join(unknown)}; allowed: {', '.join(CONFIGS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.steps is not None and args.steps < 2:
        p.error("--steps must be at least 2 (the first step is warm-up)")
    if args.out is None:
        args.out = os.path.join(os.path.dirname(HERE), "build", "bench_peer.json")
    return args


def machine_info(kuai, timeout):
    """The CPU and tier from `kuai info`, and the OPENBLAS_CORETYPE the PyTorch peer needs to run
    at its best: where OpenBLAS falls back to a generic core on this CPU, kuai reports the core it
    selected instead (`OpenBLAS chose X (...); kuai selected Y`), and the peer gets Y too."""
    try:
        out = subprocess.run([kuai, "info"], capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"cpu": f"n/a ({e})", "tier": "n/a", "openblas_coretype": None}
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key in ("cpu", "flags", "tier", "OpenBLAS", "oneDNN"):
            fields[key] = value.strip()
    chosen = re.search(r"kuai selected (\w+)", fields.get("OpenBLAS", ""))
    return {
        "cpu": fields.get("cpu", "n/a"),
        "flags": fields.get("flags", ""),
        "tier": fields.get("tier", "n/a"),
        "openblas": fields.get("OpenBLAS", ""),
        "openblas_coretype": chosen.group(1).upper() if chosen else None,
    }


def main(argv=None):
    args = parse_args(argv)
    kuai = os.path.abspath(args.kuai) if os.sep in args.kuai else args.kuai
    machine = machine_info(kuai, args.timeout)
    print(f"cpu: {machine['cpu']}")
    print(f"flags: {machine.get('flags', '')}")
    print(f"kuai tier: {machine['tier']}")
    print(f"kuai OpenBLAS: {machine.get('openblas', '')}")

    peak, peak_note = theoretical_peak(THREADS)
    gemm, gemm_error = measure_gemm(kuai, args.timeout)
    print(f"theoretical fp32 peak: {peak_note}")
    if gemm is None:
        print(f"measured GEMM ceiling (`{args.kuai} bench gemm`): n/a ({gemm_error})")
    else:
        print(f"measured GEMM ceiling (`{args.kuai} bench gemm`): {gemm:.1f} GFLOP/s")
    print(f"model FLOPs: {FLOPS_FORMULA}")
    sys.stdout.flush()

    kuai_env = {"OMP_NUM_THREADS": str(THREADS)}
    torch_env = {"OMP_NUM_THREADS": str(THREADS), "OMP_WAIT_POLICY": "PASSIVE"}
    cap = os.environ.get("KUAI_MAX_ISA", "").lower()
    if cap in PEER_CAPS:
        # kuai runs capped at a lower tier: cap the peer the same way (ATen's kernels, its oneDNN).
        aten, onednn = PEER_CAPS[cap]
        torch_env.update({"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn,
                          "DNNL_MAX_CPU_ISA": onednn})
        print(f"peer: KUAI_MAX_ISA={cap}, so ATEN_CPU_CAPABILITY={aten} ONEDNN_MAX_CPU_ISA={onednn}")
    if machine["openblas_coretype"] and "OPENBLAS_CORETYPE" not in os.environ:
        # PyTorch's OpenBLAS misreads this CPU as kuai's did: give the peer the same core.
        torch_env["OPENBLAS_CORETYPE"] = machine["openblas_coretype"]
        print(f"peer: OPENBLAS_CORETYPE={machine['openblas_coretype']} (OpenBLAS falls back to a "
              "generic core on this CPU); kuai runs with no variables set")
    report = {
        "threads": THREADS,
        "precision": args.precision,
        "machine": machine,
        "peer_env": torch_env,
        "peak_gflops": peak,
        "peak_note": peak_note,
        "gemm_gflops": gemm,
        "flops_formula": FLOPS_FORMULA,
        "configs": {},
    }
    gemm_before = gemm  # the reading just before the next configuration's runs
    for name in args.configs:
        cfg = CONFIGS[name]
        steps = args.steps or cfg["steps"]
        kuai_runs, torch_runs = [], []
        arms = [
            ("kuai", kuai_command(kuai, cfg, steps, args.precision), kuai_env, kuai_runs),
            ("torch", torch_command(cfg, steps, args.precision), torch_env, torch_runs),
        ]
        for r in range(args.rounds):
            # ABBA: kuai first in even rounds, PyTorch first in odd ones, so that neither always
            # runs on a cold (or a warmed-up) machine.
            for label, cmd, env, runs in arms if r % 2 == 0 else arms[::-1]:
                result, error, wall = run(cmd, env, args.timeout)
                runs.append(result)
                status = (
                    f"{result['tokens_per_s']:.1f} tok/s" if result else f"FAILED: {error}"
                )
                print(f"[{name} round {r + 1}/{args.rounds}] {label}: {status} ({wall:.1f} s)")
                sys.stdout.flush()
        gemm_after, _ = measure_gemm(kuai, args.timeout)
        readings = [g for g in (gemm_before, gemm_after) if g is not None]
        gemm_here = max(readings) if readings else None
        k = summarize(kuai_runs, cfg, peak, gemm_here)
        t = summarize(torch_runs, cfg, peak, gemm_here)
        print_table(name, cfg, k, t, steps, args.rounds)
        print(f"   GEMM ceiling around these runs: {fmt(gemm_before)} before, {fmt(gemm_after)} "
              f"after; the share is of the higher, {fmt(gemm_here)} GFLOP/s")
        gemm_before = gemm_after
        report["configs"][name] = {
            "config": {key: value for key, value in cfg.items() if key != "steps"},
            "steps": steps,
            "rounds": args.rounds,
            "non_embedding_params_with_lm_head": non_embedding_params_with_lm_head(cfg),
            "flops_per_step": flops_per_step(cfg),
            "kuai": {**k, "runs": kuai_runs},
            "torch": {**t, "runs": torch_runs},
            "ratio_tokens_per_s": ratio(k["tokens_per_s"], t["tokens_per_s"]),
            "ratio_peak_rss": ratio(k["peak_rss_mib"], t["peak_rss_mib"]),
            "gemm_gflops_around": gemm_here,
        }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"\nwrote {args.out}")
    ok = all(
        c["kuai"]["runs_ok"] and c["torch"]["runs_ok"] for c in report["configs"].values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
