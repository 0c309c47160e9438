#!/bin/bash
# kuai launch on one host (apps/kuai/launch.cpp; the multi-host faults are tests/multihost/):
#   1. A rank SIGKILLed mid-run: the job ends naming it, the launcher resumes from `latest`, the
#      run finishes, its final loss equals an uninterrupted run's bit for bit; while it runs, a
#      second trainer on the run directory is refused (the launcher holds the lock).
#   2. A job that fails before completing a step (its data file is missing: the ranks find out,
#      not the launcher) is restarted once, then given up: not retried up to --max-restarts.
#   3. --max-restarts is a bound: rank 1 killed twice with one restart allowed ends the launcher
#      with an error after the second.
# usage: launch.sh MPIRUN KUAI DATA
set -u
mpirun=$1
kuai=$2
data=$3
dir=$(mktemp -d)
launcher=
trap '[ -n "$launcher" ] && kill -9 $launcher 2>/dev/null; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; grep -a "^kuai" "$dir"/*.out 2>/dev/null | cut -c1-300; exit 1; }
export OMP_NUM_THREADS=1
mpi_args="--allow-run-as-root --oversubscribe -x OMP_NUM_THREADS"
args=(--data.path="$data" --model.n_layer=2 --model.d_model=64 --model.n_head=2
      --model.seq_len=64 --train.batch_size=4 --train.eval_every=0 --train.log_every=1
      --train.threads=1 --data.workers=1 --log.tensorboard=false --log.progress=off
      --checkpoint.save_every=20 --dist.timeout_s=10 --run.dir="$dir")
# shellcheck source=../support/launched_run.sh
source "$(dirname "$0")/../support/launched_run.sh"
# The pid of rank $2 of run $1 (its command is `$kuai train ...`, OMPI_COMM_WORLD_RANK=$2).
rank_pid() {
  local p
  for p in $(pgrep -f "^$kuai train .*--run.name=$1"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" &&
      { echo "$p"; return; }
  done
}

# 1. A kill, a resume, and the lock held throughout.
steps=300
"$kuai" launch --np 2 --max-restarts 2 --mpirun "$mpirun" --mpirun-args "$mpi_args" -- \
  train "${args[@]}" --train.steps=$steps --run.name=one > "$dir/one.out" 2>&1 &
launcher=$!
wait_step one 50
"$kuai" train "${args[@]}" --train.steps=$steps --run.name=one > "$dir/intruder.log" 2>&1 &&
  fail "a second trainer ran on the launcher's run directory"
grep -q "in use by pid $launcher" "$dir/intruder.log" || { cat "$dir/intruder.log"; fail "the refusal does not name the launcher"; }
# Both ranks ignore SIGPIPE: rank 0 writing to the killed rank's socket must not die by a signal
# before it names rank 1 (mpirun would report rank 0 first).
for r in 0 1; do expect_sigpipe_ignored "$(rank_pid one $r)" "rank $r"; done
kill -9 "$(rank_pid one 1)"
wait "$launcher"
rc=$?
launcher=
[ "$rc" = 0 ] || fail "kuai launch ended with $rc"
grep -aEq "^kuai launch: the job failed .*rank 1 \(on [^)]*\) (never reached it|no longer answers)" "$dir/one.out" ||
  fail "the failure line does not name rank 1"
grep -aq "^kuai launch: restart 1 of 2 (.*): resuming from step [1-9][0-9]* on 2 ranks" "$dir/one.out" ||
  fail "no restart from a checkpoint"
grep -aq "^kuai launch: the job finished after 1 restart" "$dir/one.out" || fail "no end line"
"$mpirun" $mpi_args -np 2 "$kuai" train "${args[@]}" --train.steps=$steps --run.name=plain \
  > "$dir/plain.log" 2>&1 || { cat "$dir/plain.log"; fail "the uninterrupted run failed"; }
[ "$(loss_at one $steps)" = "$(loss_at plain $steps)" ] ||
  fail "final loss $(loss_at one $steps), uninterrupted $(loss_at plain $steps)"
echo "1: a killed rank named, $(grep -ao 'resuming from step [0-9]*' "$dir/one.out"), final loss bit for bit; a second trainer refused meanwhile"

# 2. A job that cannot complete a step: one restart, then given up.
start=$SECONDS
"$kuai" launch --np 2 --max-restarts 5 --mpirun "$mpirun" --mpirun-args "$mpi_args" -- \
  train "${args[@]}" --train.steps=10 --data.path="$dir/missing.bin" --run.name=bad \
  > "$dir/bad.out" 2>&1 &&
  fail "a job that cannot start was reported finished"
grep -aq "^kuai launch: giving up: the job failed twice in a row before completing a step" "$dir/bad.out" ||
  fail "the launcher did not give up on a job that never completes a step"
[ "$(grep -ac "^kuai launch: restart" "$dir/bad.out")" = 1 ] || fail "not exactly one restart"
grep -aq "^kuai launch: the job failed (exit status 1): kuai train: error: .*missing.bin" "$dir/bad.out" ||
  fail "the failure line does not give the rank's error"
echo "2: a job failing before its first step: restarted once, given up after $((SECONDS - start)) s"

# 3. The restart bound.
"$kuai" launch --np 2 --max-restarts 1 --mpirun "$mpirun" --mpirun-args "$mpi_args" -- \
  train "${args[@]}" --train.steps=100000 --run.name=bound > "$dir/bound.out" 2>&1 &
launcher=$!
for round in 1 2; do
  wait_step bound $((round * 30))
  pid=$(rank_pid bound 1)
  [ -n "$pid" ] || fail "no rank 1 to kill in round $round"
  kill -9 "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
done
wait "$launcher"
rc=$?
launcher=
[ "$rc" = 1 ] || fail "kuai launch ended with $rc after its restarts were used"
grep -aq "^kuai launch: giving up: 1 restart allowed" "$dir/bound.out" || fail "no word of the bound"
echo "3: the second failure with --max-restarts 1 ends the launcher"
echo "PASS: kuai launch restarts, holds its run directory, and stops when it must"
