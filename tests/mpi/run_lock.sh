#!/bin/bash
# One writer per run directory under mpirun (kuai/train/run_lock.h): the two ranks of one job
# share the run directory (ZeRO-1, so both write checkpoint shards into it); while a trainer
# holds the run, a second two-rank job is refused with the holder's pid, promptly and without
# touching a file; after the holder is SIGKILLed, a two-rank job resumes the run.
# usage: run_lock.sh MPIRUN KUAI
set -u
mpirun=$1
kuai=$2
dir=$(mktemp -d)
trap 'kill -9 $holder 2>/dev/null; rm -rf "$dir"' EXIT
holder=
export OMP_NUM_THREADS=1
mpi() { timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS "$@"; }
fail() { echo "FAIL: $*"; exit 1; }
tiny=(--data.source=synthetic --model.n_layer=1 --model.d_model=32 --model.n_head=2
      --model.seq_len=16 --model.vocab_size=256 --train.batch_size=2 --train.eval_every=0
      --train.threads=1 --data.workers=1 --checkpoint.save_every=2 --dist.zero=1
      --run.dir="$dir" --run.name=r)

# 1. The ranks of one job are not refused.
mpi "$kuai" train "${tiny[@]}" --train.steps=4 > "$dir/job1.log" 2>&1 || {
  cat "$dir/job1.log"; fail "a two-rank job was refused its own run directory"; }
[ -f "$dir/r/ckpt-4/optimizer.rank1.safetensors" ] || fail "rank 1 wrote no shard"

# 2. A second job while a trainer holds the run: refused, the files untouched.
"$kuai" train --resume "$dir/r" --train.steps=100000000 > "$dir/holder.log" 2>&1 &
holder=$!
for _ in $(seq 300); do
  grep -q "^pid $holder\$" "$dir/r/lock" 2>/dev/null && break
  sleep 0.05
done
grep -q "^pid $holder\$" "$dir/r/lock" || { cat "$dir/holder.log"; fail "the holder never locked"; }
kill -STOP $holder
sleep 0.2
before=$(cd "$dir/r" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
start=$(date +%s)
mpi "$kuai" train --resume "$dir/r" > "$dir/job2.log" 2>&1 && { cat "$dir/job2.log"; fail "a second job was not refused"; }
took=$(( $(date +%s) - start ))
grep -q "in use by pid $holder" "$dir/job2.log" || { cat "$dir/job2.log"; fail "the refusal does not name the holder"; }
after=$(cd "$dir/r" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
[ "$before" = "$after" ] || fail "the refused job changed the run directory"
[ $took -lt 60 ] || fail "the refusal took ${took}s"

# 3. The holder is killed: its lock is free at once, and a two-rank job resumes.
kill -9 $holder
wait $holder 2>/dev/null
mpi "$kuai" train --resume "$dir/r" --train.steps=8 > "$dir/job3.log" 2>&1 || {
  cat "$dir/job3.log"; fail "the job after the kill did not run"; }
grep -q "resumed from" "$dir/job3.log" || { cat "$dir/job3.log"; fail "it did not resume"; }
echo "PASS: one job's ranks share the run; a second job was refused in ${took}s naming pid $holder; the run resumed after the kill"
