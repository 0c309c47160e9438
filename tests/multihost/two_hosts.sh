#!/bin/bash
# Two hosts of the test's own (hosts.sh: network namespaces, TCP only between them), one rank on
# each, against two ranks on one host (shared memory):
#   - DDP equals DDP on one host bit for bit: every step's loss and gradient norm, and the
#     exported weights;
#   - ZeRO-3 likewise;
#   - the bytes each rank's host sent on its virtual link are at least the bytes the rank's group
#     reports handing to collectives (comm_bytes_sent in the RESULT line; ZeRO-3: at least the
#     share of them a rank must send, below): the collectives went over TCP;
#   - `kuai bench link` measures that link (latency and bandwidth of the all-reduce).
# usage: two_hosts.sh MPIRUN KUAI   (KEEP=1 keeps the temporary directory)
set -u
MPIRUN=$1
kuai=$2
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=hosts.sh
source "$here/hosts.sh"
dir=$(mktemp -d)
cleanup() { hosts_down; [ "${KEEP:-0}" = 1 ] && echo "kept: $dir" || rm -rf "$dir"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
export OMP_NUM_THREADS=1

hosts_up 2
printf 'node0 slots=1\nnode1 slots=1\n' > "$dir/hosts"

args=(--data.source=synthetic --model.n_layer=2 --model.d_model=64 --model.n_head=2
      --model.seq_len=32 --model.vocab_size=256 --train.steps=8 --train.batch_size=4
      --train.eval_every=0 --train.log_every=1 --train.threads=1 --data.workers=1
      --log.tensorboard=false --log.progress=off --run.dir="$dir")

# The losses and norms of a run, one step per line, exactly as logged.
steps() { python3 - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "loss" in r:
        print(r["step"], repr(r["loss"]), repr(r.get("grad_norm")))
EOF
}

# name zero-stage
compare() {
  local name=$1 zero=$2
  timeout 120 "$MPIRUN" --allow-run-as-root --oversubscribe -np 2 -x OMP_NUM_THREADS \
    "$kuai" train "${args[@]}" --dist.zero="$zero" --run.name="$name-one" > "$dir/$name-one.log" 2>&1 ||
    { cat "$dir/$name-one.log"; fail "$name: the one-host run failed"; }
  local tx0 tx1
  tx0=$(tx_bytes 0)
  tx1=$(tx_bytes 1)
  timeout 120 "$HOST_MPIRUN" --hostfile "$dir/hosts" -np 2 "$kuai" train "${args[@]}" \
    --dist.zero="$zero" --run.name="$name-two" > "$dir/$name-two.log" 2>&1 ||
    { cat "$dir/$name-two.log"; fail "$name: the two-host run failed"; }
  tx0=$(( $(tx_bytes 0) - tx0 ))
  tx1=$(( $(tx_bytes 1) - tx1 ))
  # One rank per host, on different hosts.
  grep -q "2 ranks (mpi)" "$dir/$name-two.log" || { cat "$dir/$name-two.log"; fail "$name: not 2 ranks"; }
  steps "$dir/$name-one/metrics.jsonl" > "$dir/$name-one.steps"
  steps "$dir/$name-two/metrics.jsonl" > "$dir/$name-two.steps"
  [ "$(wc -l < "$dir/$name-one.steps")" = 8 ] || fail "$name: not 8 steps logged"
  cmp -s "$dir/$name-one.steps" "$dir/$name-two.steps" ||
    { diff "$dir/$name-one.steps" "$dir/$name-two.steps"; fail "$name: two hosts differ from one"; }
  cmp -s "$dir/$name-one/model.safetensors" "$dir/$name-two/model.safetensors" ||
    fail "$name: the exported weights differ"
  local sent sent0 sent1
  sent=$(grep -o 'comm_bytes_sent=[0-9,]*' "$dir/$name-two.log" | cut -d= -f2)
  sent0=${sent%,*}
  sent1=${sent#*,}
  [ -n "$sent0" ] && [ -n "$sent1" ] && [ "$sent0" -gt 0 ] && [ "$sent1" -gt 0 ] ||
    { cat "$dir/$name-two.log"; fail "$name: no comm_bytes_sent of both ranks"; }
  echo "$name: 8 steps bit for bit on 2 hosts and on 1; ranks 0 and 1 handed $sent0 and" \
       "$sent1 B to collectives, node0's and node1's links sent $tx0 and $tx1 B"
  # DDP's all-reduce must send at least its whole buffer from each rank (2 ranks: half in the
  # reduce-scatter phase, half in the gather phase), so a link carries at least what its rank
  # handed over. A reduce-scatter is handed its whole buffer but sends only the other ranks'
  # parts, (N - 1)/N of it: ZeRO-3's links are held to that share.
  local need0=$sent0 need1=$sent1
  [ "$zero" = 3 ] && need0=$((sent0 / 2)) && need1=$((sent1 / 2))
  [ "$tx0" -ge "$need0" ] || fail "$name: node0's link sent $tx0 B, fewer than $need0 B"
  [ "$tx1" -ge "$need1" ] || fail "$name: node1's link sent $tx1 B, fewer than $need1 B"
}

compare ddp 0
compare zero3 3

# The link itself, as `kuai bench link` measures it.
timeout 120 "$HOST_MPIRUN" --hostfile "$dir/hosts" -np 2 "$kuai" bench link --no-save \
  > "$dir/link.log" 2>&1 || { cat "$dir/link.log"; fail "bench link failed"; }
grep -E "^fit:|RESULT" "$dir/link.log"
grep -q "RESULT link_latency_us=[0-9.]* link_gbs=[0-9.]*" "$dir/link.log" || fail "no link figures"
echo "PASS: DDP and ZeRO-3 on two hosts over TCP equal one host bit for bit"
