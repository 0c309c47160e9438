# Reading a run while `kuai launch` drives it (sourced by tests/mpi/launch.sh and
# tests/multihost/faults.sh). The caller sets $dir (the run.dir of its runs) and $launcher (the
# launcher's pid) and defines fail MESSAGE.
# shellcheck shell=bash

# The last step run $1 has logged (0 before any).
last_step() {
  tail -n 1 "$dir/$1/metrics.jsonl" 2>/dev/null |
    sed -n 's/^{"step": \([0-9]*\),.*/\1/p' | grep . || echo 0
}

# The loss of step $2 as run $1 last logged it (a step redone after a restart: its last value).
loss_at() { python3 - "$dir/$1/metrics.jsonl" "$2" <<'PY'
import json, sys
loss = None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("step") == int(sys.argv[2]) and "loss" in r:
        loss = r["loss"]
print(repr(loss))
PY
}

# Waits until run $1 has logged step $2 or more (at most 120 s); fails if the launcher is gone.
wait_step() {
  local t0=$SECONDS
  while [ "$(last_step "$1")" -lt "$2" ]; do
    kill -0 "$launcher" 2>/dev/null || fail "the launcher ended before step $2 of $1"
    [ $((SECONDS - t0)) -gt 120 ] && fail "$1: step $2 not reached in 120 s"
    sleep 0.05
  done
}

# Fails with message $2 unless process $1 ignores SIGPIPE (bit 13 of its SigIgn mask): a rank
# writing to a dead peer's socket must not die by a signal before it names the dead rank.
expect_sigpipe_ignored() {
  local ign
  ign=$(awk '/^SigIgn:/ {print $2}' "/proc/$1/status" 2>/dev/null)
  [ -n "$ign" ] && (( (16#$ign >> 12) & 1 )) || fail "$2 does not ignore SIGPIPE (SigIgn ${ign:-unread})"
}
