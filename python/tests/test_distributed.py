"""kuai.distributed from Python on 2 ranks (mpirun, Debian's OpenMPI): each case runs
mpi/dist_cases.py on every rank, which also runs the plain one-process version inside each rank.

- DDP's loop (loss.backward() returns with averaged gradients) equals one process with the double
  batch: losses within 1e-5 relative, parameters within 1e-5 of their scale (fp32: the mean over
  the batch is summed in another order), every byte launched during backward;
- no_sync accumulation: one all-reduce per step, equal to the whole batch;
- compression hooks: half the bytes on the wire, losses within 1e-3 of fp32's;
- ZeroRedundancyOptimizer (stages 1 and 2, and 3 over fully_shard) equals AdamW bit for bit with
  half the state;
- the Python loop equals the engine's TrainStep(ddp=) bit for bit.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="OpenMPI's mpirun is not installed")


def mpirun(args, np_=2, timeout=300):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    cmd = [MPIRUN, "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
           sys.executable] + [str(a) for a in args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def run_case(case, corpus, tmp_path):
    out = tmp_path / f"{case}.json"
    mpirun([HERE / "mpi" / "dist_cases.py", case, corpus, out])
    return json.loads(out.read_text())


def close(a, b, rel):
    return all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b)) and len(a) == len(b)


def test_ddp_loop_equals_one_process_with_the_double_batch(corpus, tmp_path):
    r = run_case("ddp", corpus, tmp_path)
    assert r["world"] == 2
    assert close(r["losses"], r["base_losses"], 1e-5), (r["losses"], r["base_losses"])
    assert r["max_param_diff"] <= 1e-5 * r["param_scale"]
    # every step all-reduces every gradient once (the loss average comes after the counter is
    # read); the first forward also broadcast rank 0's weights
    sent = r["bytes_sent"]
    assert all(s == sent[1] for s in sent[1:]) and sent[0] > sent[1], sent
    assert sent[1] >= r["bytes_per_sync"] > 0, (sent, r["bytes_per_sync"])
    assert r["in_backward"] > 0  # buckets launched while backward ran


def test_no_sync_accumulation_communicates_once_per_step(corpus, tmp_path):
    r = run_case("no_sync", corpus, tmp_path)
    assert close(r["losses"], r["base_losses"], 1e-5), (r["losses"], r["base_losses"])
    assert r["max_param_diff"] <= 1e-5 * r["param_scale"]
    # one sync's bytes per step (the loss averages come after the counter is read)
    sent = r["bytes_sent"]
    assert all(s == sent[1] for s in sent[1:]), sent
    assert r["bytes_per_sync"] <= sent[1] < 2 * r["bytes_per_sync"], (sent, r["bytes_per_sync"])


def test_compression_hooks_halve_the_bytes(corpus, tmp_path):
    r = run_case("compression", corpus, tmp_path)
    none, fp16, bf16 = r["none"], r["fp16"], r["bf16_ef"]
    assert fp16["bytes_per_sync"] * 2 == none["bytes_per_sync"]
    assert bf16["bytes_per_sync"] * 2 == none["bytes_per_sync"]
    assert fp16["bytes_sent"] * 2 == none["bytes_sent"]
    assert close(fp16["losses"], none["losses"], 1e-3)
    assert close(bf16["losses"], none["losses"], 1e-3)
    assert fp16["losses"] != none["losses"]  # the wire really carried fp16


def test_zero_redundancy_optimizer_equals_adamw_with_half_the_state(corpus, tmp_path):
    r = run_case("zero", corpus, tmp_path)
    for stage in ("zero1", "zero2", "zero3", "zero1_compiled", "zero2_compiled", "zero3_compiled"):
        assert r[stage]["losses"] == r["adamw"]["losses"], stage
        assert r[stage]["checksum"] == r["adamw"]["checksum"], stage
        assert r[stage]["params"] == r["adamw"]["params"], stage
        assert r[stage]["state_bytes"] <= r["adamw"]["state_bytes"] / 2 + 64 * 4
        if stage.endswith("_compiled"):
            assert r[stage]["captures"] == 1, stage


def test_python_ddp_loop_equals_the_engines_step(corpus, tmp_path):
    r = run_case("loop_equals_trainstep", corpus, tmp_path)
    assert r["loop"] == r["step"]
    assert r["loop_first"] == r["step_first"]


# ---- the article's multi-rank examples (examples/02, 07, 08), run as written on 2 ranks ----

EXAMPLES = HERE.parents[1] / "examples"


def run_example(name, corpus, *extra):
    r = mpirun([EXAMPLES / name, "--steps", "3", "--data", corpus, *extra])
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return dict(kv.split("=", 1) for kv in line.split()[1:])


def test_example_ddp(corpus):
    r = run_example("02_ddp.py", corpus)
    assert r["world"] == "2" and float(r["last_loss"]) < float(r["first_loss"])
    assert float(r["overlap"]) > 0  # buckets launched while backward ran


def test_example_compression_halves_the_wire(corpus):
    r = run_example("07_compression.py", corpus)
    assert int(r["bytes_per_sync"]) * 2 == int(r["bytes_per_sync_fp32"])
    assert float(r["wire_ratio"]) == 0.5
    assert abs(float(r["last_loss"]) - float(r["last_loss_fp32"])) < 1e-2


def test_example_zero_shards_and_offload(corpus):
    r = run_example("08_zero_offload.py", corpus)
    assert r["world"] == "2" and float(r["zero_state_ratio"]) <= 0.51
    assert r["zero_equals_adamw"] == "True" and r["offload_equals_adamw"] == "True"
