#!/bin/bash
# ZeRO-3 checkpoints re-shard on load (kuai/train/checkpoint.h): a 2-rank ZeRO-3 run on KJV saves
# ckpt-5 as each rank's model and optimizer shards (no whole model anywhere); it resumes on 2
# ranks, on 1, on 3 (--oversubscribe) and on 1 rank without ZeRO, with the same global batch
# (12 rows: 6 x 2, 12 x 1, 4 x 3), and every resumed run continues with the losses of the
# uninterrupted run, within 1e-6 relative (2 ranks: bit for bit). Each rank's batch is even: the
# loader draws its rows two per random block, so the rows of a global batch are the same rows
# whatever their split across ranks when every rank starts on a block's first row.
# usage: zero3_reshard.sh MPIRUN KUAI DATA   (KEEP=1 keeps the temporary directory)
set -u
mpirun=$1
kuai=$2
data=$3
dir=$(mktemp -d)
[ "${KEEP:-0}" = 1 ] && echo "kept: $dir" || trap 'rm -rf "$dir"' EXIT
export OMP_NUM_THREADS=1
fail() { echo "FAIL: $*"; exit 1; }
mpi() { local n=$1; shift; timeout 300 "$mpirun" --allow-run-as-root --oversubscribe -np "$n" \
          -x OMP_NUM_THREADS "$@"; }
args=(--data.path="$data" --model.n_layer=2 --model.d_model=32 --model.n_head=2
      --model.seq_len=32 --train.steps=10 --train.lr=3e-3 --train.warmup_steps=2
      --train.eval_every=0 --train.log_every=1 --train.threads=1 --data.workers=1
      --log.tensorboard=false --log.progress=off --checkpoint.save_every=5
      --checkpoint.keep_last=10 --run.dir="$dir")

mpi 2 "$kuai" train "${args[@]}" --dist.zero=3 --train.batch_size=6 --run.name=full \
  > "$dir/full.log" 2>&1 || { cat "$dir/full.log"; fail "the 2-rank ZeRO-3 run failed"; }
ckpt="$dir/full/ckpt-5"
[ -f "$ckpt/model.rank1.safetensors" ] || fail "rank 1 wrote no model shard"
[ -e "$ckpt/model.safetensors" ] && fail "a whole model was written into the checkpoint"

# The losses of steps 6..10 in a run's metrics.jsonl, one per line.
losses() { python3 - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "loss" in r and r["step"] > 5:
        print(r["step"], repr(r["loss"]))
EOF
}
losses "$dir/full/metrics.jsonl" > "$dir/full.losses"
[ "$(wc -l < "$dir/full.losses")" = 5 ] || { cat "$dir/full/metrics.jsonl"; fail "no losses of steps 6..10"; }

# name ranks batch exact [overrides...]
resume() {
  local name=$1 n=$2 b=$3 exact=$4; shift 4
  local cmd=("$kuai" train --resume "$ckpt" --run.name="$name" --train.batch_size="$b" "$@")
  if [ "$n" = 1 ]; then "${cmd[@]}"; else mpi "$n" "${cmd[@]}"; fi > "$dir/$name.log" 2>&1 || {
    cat "$dir/$name.log"; fail "$name: the resume failed"; }
  grep -q "resumed from" "$dir/$name.log" || { cat "$dir/$name.log"; fail "$name did not resume"; }
  # On another world size the run says so, with the global batch it has.
  if [ "$n" != 2 ]; then
    grep -q "written by 2 ranks and this run has $n: .*now 12)" "$dir/$name.log" || {
      cat "$dir/$name.log"; fail "$name: no note of the change of world size"; }
  elif grep -q "re-sharded on load" "$dir/$name.log"; then
    fail "$name: a note of a change of world size on the same world size"
  fi
  losses "$dir/$name/metrics.jsonl" > "$dir/$name.losses"
  python3 - "$dir/full.losses" "$dir/$name.losses" "$exact" "$name" <<'EOF' || exit 1
import sys
want = [l.split() for l in open(sys.argv[1])]
got = [l.split() for l in open(sys.argv[2])]
exact, name = sys.argv[3] == "1", sys.argv[4]
if [w[0] for w in want] != [g[0] for g in got]:
    sys.exit(f"FAIL: {name}: steps {[g[0] for g in got]}, expected {[w[0] for w in want]}")
worst = 0.0
for (s, w), (_, g) in zip(want, got):
    w, g = float(w), float(g)
    rel = abs(g - w) / abs(w)
    worst = max(worst, rel)
    if (exact and g != w) or rel > 1e-6:
        sys.exit(f"FAIL: {name}: step {s} loss {g!r}, uninterrupted {w!r} (relative {rel:.3g})")
print(f"{name}: steps 6..10 within {worst:.3g} relative of the uninterrupted run")
EOF
}
resume two 2 6 1 --dist.zero=3
resume one 1 12 0 --dist.zero=3
resume three 3 4 0 --dist.zero=3
resume plain 1 12 0 --dist.zero=0
echo "PASS: a 2-rank ZeRO-3 checkpoint resumed on 2, 1 and 3 ranks and without ZeRO"
