"""The examples/ scripts (the article's techniques in kuai), each run as a user would, for a few
steps on the small corpus: their RESULT line shows the technique (no timing asserts)."""

import math
import os
import pathlib
import subprocess
import sys

import kuai

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
# The folder kuai was imported from (conftest puts the build tree on sys.path when needed).
KUAI_PATH = str(pathlib.Path(kuai.__file__).resolve().parents[1])


def run(script, corpus, *flags):
    """Runs examples/<script> on corpus; returns its RESULT line as a dict of str."""
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (KUAI_PATH, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--data", corpus, *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:])


def num(r, key):
    v = float(r[key])
    assert math.isfinite(v), (key, r)
    return v


def test_mixed_precision(corpus):
    r = run("01_mixed_precision.py", corpus, "--steps", "4")
    for p in ("fp16", "bf16", "fp32"):
        assert num(r, f"{p}_last") < num(r, f"{p}_first"), r
    assert num(r, "fp16_scale") > 0
    assert int(r["fp16_loop_host_reads"]) == 0  # the scaler's state stays on the device


def test_gradient_accumulation(corpus):
    r = run("03_gradient_accumulation.py", corpus, "--steps", "2", "--accum", "4")
    assert num(r, "peak_accum") < 0.7 * num(r, "peak_full"), r
    assert num(r, "resident") > 0
    assert abs(num(r, "loss_accum") - num(r, "loss_full")) <= 1e-3 * num(r, "loss_full"), r


def test_compile(corpus):
    r = run("04_compile.py", corpus, "--steps", "4")
    assert int(r["captures"]) == 1 and int(r["replays"]) == 3, r
    assert num(r, "max_rel_diff") <= 1e-6, r
    assert num(r, "first_call_ms") > 0


def test_dataloader(corpus):
    r = run("05_dataloader.py", corpus, "--steps", "5", "--workers", "2")
    assert int(r["next_index"]) == 5
    assert num(r, "wait_ms_workers") >= 0 and num(r, "wait_ms_no_workers") >= 0


def test_flash_attention(corpus):
    r = run("06_flash_attention.py", corpus, "--long_t", "512")
    assert num(r, "max_diff") <= 1e-5 and num(r, "grad_max_diff") <= 1e-5, r
    assert num(r, "peak_flash") < num(r, "peak_naive"), r
    assert int(r["replaced"]) == 2  # both layers' attention
    assert abs(num(r, "loss_after") - num(r, "loss_before")) <= 1e-5, r


def test_checkpoints(corpus):
    r = run("09_checkpoints.py", corpus, "--steps", "4")
    assert r["full_resume_bit_exact"] == "True", r
    assert r["weights_resume_bit_exact"] == "False", r
    assert 2.9 < num(r, "size_ratio") < 3.1, r


def test_fewer_syncs(corpus, tmp_path):
    r = run("10_fewer_syncs.py", corpus, "--steps", "4", "--log_dir", str(tmp_path))
    assert num(r, "reads_per_step_writer") == 0, r
    assert num(r, "reads_per_step_item") == 1, r
    event = pathlib.Path(r["event_file"])
    assert event.parent == tmp_path and event.stat().st_size > 0
    assert int(r["event_loss_scalars"]) == 4 and int(r["logged"]) == 4, r
    assert r["logged_equal_item"] == "True", r
