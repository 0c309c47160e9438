#!/bin/bash
# Runs that survive (kuai launch, apps/kuai/launch.cpp) on hosts of the test's own (hosts.sh):
#
# 1. Three hosts, one rank each, `kuai launch --np 3 --min-np 2 --max-restarts 3`. Three faults at
#    random steps, in random order, each on a random host of the running job: a rank SIGKILLed,
#    a host's link cut (its interface down, for good), a rank frozen (SIGSTOP) past
#    dist.timeout_s. Each fault must end the job within dist.timeout_s + 10 s, with a line naming
#    the rank's host; the launcher restarts from `latest` on what answers (the cut host no
#    longer does: 2 ranks, the global batch kept by accumulation). The run finishes all its steps
#    and its final loss is within 1e-5 relative of an uninterrupted run on 2 ranks with the
#    batch split the launcher chose.
# 2. Two hosts under ZeRO-3 (every rank writes its model and optimizer shards), rank 1 SIGKILLed
#    while a checkpoint is being saved (KUAI_FAULT_SAVE_STALL_S holds each rank's save with
#    `ckpt-<step>.tmp` in place): `latest` still names the previous checkpoint, the launcher
#    resumes from it, and the final loss equals an uninterrupted 2-rank ZeRO-3 run bit for bit.
#
# No process and no namespace is left behind (hosts_down on exit).
# The data is KJV's bytes: random windows drawn two rows per block, so a global batch split
# another way (3 ranks x 4 rows, 2 ranks x 2 rows x 3 micro-batches) is the same rows.
# usage: faults.sh MPIRUN KUAI DATA   (SEED=n picks the faults' steps, order and hosts; KEEP=1)
set -u
MPIRUN=$1
kuai=$2
data=$3
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=hosts.sh
source "$here/hosts.sh"
dir=$(mktemp -d)
launcher=
cleanup() {
  [ -n "$launcher" ] && kill -9 "$launcher" 2>/dev/null
  hosts_down
  [ "${KEEP:-0}" = 1 ] && echo "kept: $dir" || rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  [ -f "$dir/launch.out" ] && grep -a "^kuai" "$dir/launch.out" | cut -c1-400
  exit 1
}
export OMP_NUM_THREADS=1
seed=${SEED:-$(( $(date +%s) % 100000 ))}
RANDOM=$seed
echo "SEED=$seed (rerun with SEED=$seed to repeat the faults)"
timeout_s=5

args=(--data.path="$data" --model.n_layer=2 --model.d_model=64 --model.n_head=2
      --model.seq_len=64 --train.batch_size=4 --train.eval_every=0
      --train.log_every=1 --train.threads=1 --data.workers=1 --log.tensorboard=false
      --log.progress=off --checkpoint.save_every=20 --dist.timeout_s="$timeout_s" --run.dir="$dir")

# shellcheck source=../support/launched_run.sh
source "$here/../support/launched_run.sh"
# The pid of the kuai rank running on host $1 ("" when none): a process whose command is
# `$kuai train ...` (not mpirun's, which names it among its arguments).
rank_pid() {
  local p
  for p in $(host_pids "$1"); do
    [ "$(tr '\0' '\n' < "/proc/$p/cmdline" 2>/dev/null | head -n 2 | tr '\n' ' ')" = "$kuai train " ] &&
      { echo "$p"; return; }
  done
}
failures() { grep -ac "^kuai launch: the job failed" "$dir/launch.out"; }
# Once the launcher is done, nothing of the job is left on the hosts but on a cut one ($1), whose
# processes no one can reach (they end when the test removes the hosts).
no_leftovers() {
  local i t0=$SECONDS left
  for ((i = 0; i < HOSTS_N; ++i)); do
    [ "$i" = "${1:-}" ] && continue
    while left=$(host_pids "$i") && [ -n "$left" ]; do
      [ $((SECONDS - t0)) -gt 10 ] && fail "processes left on node$i: $(ps -o pid=,args= -p "$(echo "$left" | paste -sd,)" | cut -c1-200)"
      sleep 0.1
    done
  done
}
# Hosts running a rank of the job now.
job_hosts() {
  local i
  for ((i = 0; i < HOSTS_N; ++i)); do [ -n "$(rank_pid "$i")" ] && echo "$i"; done
}
# Waits for the job to end after a fault injected at time $1 (date +%s.%N), and for its restart.
wait_failure() {
  local before=$1 t0=$2 what=$3
  while [ "$(failures)" -le "$before" ]; do
    kill -0 "$launcher" 2>/dev/null || fail "$what: the launcher ended without a restart"
    sleep 0.05
  done
  local took
  took=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  echo "$what: the job ended $took s after the fault"
  python3 -c "import sys; sys.exit(0 if $took <= $timeout_s + 10 else 1)" ||
    fail "$what: the job took $took s to end (more than dist.timeout_s + 10)"
}

# --- 1. three faults on three hosts -------------------------------------------------------------
hosts_up 3
printf 'node0 slots=1\nnode1 slots=1\nnode2 slots=1\n' > "$dir/hosts"
steps=360
on_host 0 "$kuai" launch --hostfile "$dir/hosts" --np 3 --min-np 2 --max-restarts 3 \
  --mpirun "$MPIRUN" --mpirun-args "$HOST_MPI_ARGS" -- \
  train "${args[@]}" --train.steps=$steps --run.name=faults > "$dir/launch.out" 2>&1 &
launcher=$!
faults=(kill link freeze)
for ((i = 2; i > 0; --i)); do  # a random order
  j=$((RANDOM % (i + 1)))
  t=${faults[i]}; faults[i]=${faults[j]}; faults[j]=$t
done
cut_host=
for fault in "${faults[@]}"; do
  at=$(( $(last_step faults) + 15 + RANDOM % 40 ))
  wait_step faults "$at"
  mapfile -t live < <(job_hosts)
  [ "${#live[@]}" -ge 2 ] || fail "$fault: the job runs on ${#live[@]} hosts"
  host=${live[RANDOM % ${#live[@]}]}
  [ "$fault" = link ] && [ "$host" = 0 ] && host=${live[1]}  # node0 runs the launcher
  pid=$(rank_pid "$host")
  # Every rank ignores SIGPIPE: a write to a dead peer's socket must not end it by a signal before
  # the dead rank is named (mpirun would report this one first).
  for h in "${live[@]}"; do
    p=$(rank_pid "$h")
    expect_sigpipe_ignored "$p" "$fault: the rank on node$h (pid $p)"
  done
  before=$(failures)
  t0=$(date +%s.%N)
  case $fault in
    kill) kill -9 "$pid" ;;
    link) link_down "$host"; cut_host=$host ;;
    freeze) kill -STOP "$pid" ;;
  esac
  echo "$fault: node$host (rank pid $pid) at step $(last_step faults)"
  wait_failure "$before" "$t0" "$fault"
  grep -a "^kuai launch: the job failed" "$dir/launch.out" | tail -n 1 | grep -Eq "\(on node$host\)|on node node$host " ||
    fail "$fault: the failure line does not name node$host"
  [ "$fault" = freeze ] && kill -CONT "$pid" 2>/dev/null  # if it is still there, it ends now
done
wait "$launcher"
rc=$?
launcher=
[ "$rc" = 0 ] || fail "kuai launch ended with $rc"
no_leftovers "$cut_host"
grep -a "^kuai launch" "$dir/launch.out" | cut -c1-300
[ "$(grep -ac "^kuai launch: restart [0-9] of 3" "$dir/launch.out")" = 3 ] || fail "not 3 restarts"
grep -aq "^kuai launch: host node$cut_host does not answer" "$dir/launch.out" ||
  fail "the cut host node$cut_host was not found unreachable"
split=$(grep -a "^kuai launch: restart 3 of 3" "$dir/launch.out" |
        sed -n 's/.*kept as batch \([0-9]*\) x 2 ranks x accum \([0-9]*\).*/\1 \2/p')
[ -n "$split" ] || fail "the last restart is not on 2 ranks with the global batch kept"
read -r b k <<< "$split"
[ "$(last_step faults)" = "$steps" ] || fail "the run stopped at step $(last_step faults)"
grep -aq "^kuai launch: the job finished after 3 restarts" "$dir/launch.out" || fail "no end line"

# The uninterrupted run on the world size it ended with, the same batch split.
timeout 300 "$MPIRUN" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS "$kuai" train \
  "${args[@]}" --train.steps=$steps --train.batch_size="$b" --train.accum_steps="$k" \
  --run.name=plain2 > "$dir/plain2.log" 2>&1 || { cat "$dir/plain2.log"; fail "the 2-rank run failed"; }
want=$(loss_at plain2 $steps)
got=$(loss_at faults $steps)
python3 - "$want" "$got" <<'EOF' || fail "final loss $got, uninterrupted $want"
import sys
w, g = float(sys.argv[1]), float(sys.argv[2])
rel = abs(g - w) / abs(w)
print(f"final loss {g!r} after 3 faults, uninterrupted on 2 ranks {w!r}: {rel:.2g} relative")
sys.exit(0 if rel <= 1e-5 else 1)
EOF
hosts_down
! ip netns list | grep -q "^$HOSTS_PREFIX" || fail "namespaces left: $(ip netns list)"

# --- 2. a kill while a checkpoint is saved ------------------------------------------------------
hosts_up 2
printf 'node0 slots=1\nnode1 slots=1\n' > "$dir/hosts2"
steps=120
KUAI_FAULT_SAVE_STALL_S=1.5 on_host 0 "$kuai" launch --hostfile "$dir/hosts2" --np 2 \
  --max-restarts 1 --mpirun "$MPIRUN" --mpirun-args "$HOST_MPI_ARGS -x KUAI_FAULT_SAVE_STALL_S" \
  -- train "${args[@]}" --train.steps=$steps --checkpoint.save_every=40 --dist.zero=3 \
  --run.name=save \
  > "$dir/launch.out" 2>&1 &
launcher=$!
t0=$SECONDS
until [ -d "$dir/save/ckpt-80.tmp" ]; do
  kill -0 "$launcher" 2>/dev/null || fail "the launcher ended before the second save"
  [ $((SECONDS - t0)) -gt 120 ] && fail "no save of step 80 in 120 s"
  sleep 0.02
done
[ "$(cat "$dir/save/latest")" = ckpt-40 ] || fail "latest is $(cat "$dir/save/latest") mid-save"
before=$(failures)
t1=$(date +%s.%N)
kill -9 "$(rank_pid 1)"
echo "save: rank 1 (node1) killed with ckpt-80.tmp in place"
wait_failure "$before" "$t1" "save"
grep -a "^kuai launch: the job failed" "$dir/launch.out" | tail -n 1 | grep -Eq "\(on node1\)|on node node1 " ||
  fail "save: the failure line does not name node1"
grep -aq "^kuai launch: restart 1 of 1 (.*): resuming from step 40 on 2 ranks" "$dir/launch.out" ||
  fail "save: not resumed from step 40"
wait "$launcher"
rc=$?
launcher=
[ "$rc" = 0 ] || fail "kuai launch ended with $rc"
no_leftovers
timeout 300 "$MPIRUN" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS "$kuai" train \
  "${args[@]}" --train.steps=$steps --checkpoint.save_every=40 --dist.zero=3 --run.name=plain_save \
  > "$dir/plain_save.log" 2>&1 || { cat "$dir/plain_save.log"; fail "the 2-rank run failed"; }
want=$(loss_at plain_save $steps)
got=$(loss_at save $steps)
[ "$want" = "$got" ] || fail "save: final loss $got, uninterrupted $want (not bit for bit)"
echo "save: final loss $got, the uninterrupted run's bit for bit"
echo "PASS: three faults and a kill mid-save survived; every job ended within dist.timeout_s + 10 s"
