# Hosts of the tests' own: network namespaces on this machine, one per host, each with its own
# address on a virtual link to a bridge (a switch, in a namespace of its own), its own host name
# (a UTS namespace per process started there) and an /etc/hosts naming every host. mpirun's remote
# launch goes into them through an rsh agent that enters a namespace instead of ssh, and ranks on
# different hosts have no shared memory to use: their bytes go over TCP on the virtual links,
# where the interfaces count them. The file system is shared, as a cluster's would be.
#
# Sourced by the multi-host tests:
#   hosts_up N              hosts node0 .. node<N-1> at 10.77.0.1 .. ; exit 77 (skip) when this
#                           machine cannot make namespaces (not root, no iproute2)
#   on_host I CMD...        CMD on host I, as that host (its network, its name)
#   $HOST_MPIRUN ARGS...    mpirun on node0 with the hosts' launch agent and TCP only (MPIRUN
#                           names the real one)
#   HOST_MPI_ARGS           those options, for commands that take them (kuai launch)
#   host_ns I, host_if I    host I's namespace and its interface
#   tx_bytes I              bytes host I's interface has sent
#   link_down I / link_up I cut / restore host I's link
#   host_pids I             the processes running on host I
#   hosts_down              ends every process on the hosts and removes them (on EXIT)
# shellcheck shell=bash

HOSTS_PREFIX="kq$$"
HOSTS_N=0
HOSTS_DIR=""

host_ns() { echo "${HOSTS_PREFIX}n$1"; }
host_if() { echo "eth$1"; }

hosts_down() {
  local i
  for ((i = 0; i < HOSTS_N; ++i)); do
    ip netns pids "$(host_ns "$i")" 2>/dev/null | xargs -r kill -CONT 2>/dev/null
    ip netns pids "$(host_ns "$i")" 2>/dev/null | xargs -r kill -9 2>/dev/null
  done
  for ((i = 0; i < HOSTS_N; ++i)); do
    ip netns del "$(host_ns "$i")" 2>/dev/null
    rm -rf "/etc/netns/$(host_ns "$i")"
  done
  ip netns del "${HOSTS_PREFIX}sw" 2>/dev/null
  [ -n "$HOSTS_DIR" ] && rm -rf "$HOSTS_DIR"
  HOSTS_N=0
}

hosts_up() {
  local n=$1 i
  if [ "$(id -u)" != 0 ] || ! command -v ip > /dev/null || ! command -v unshare > /dev/null; then
    echo "SKIP: network namespaces need root, ip (iproute2) and unshare (scripts/setup.sh)"
    exit 77
  fi
  HOSTS_DIR=$(mktemp -d)
  ip netns add "${HOSTS_PREFIX}sw" 2> "$HOSTS_DIR/err" || {
    cat "$HOSTS_DIR/err"; echo "SKIP: this machine cannot make network namespaces"; exit 77; }
  HOSTS_N=$n
  ip -n "${HOSTS_PREFIX}sw" link add br0 type bridge
  ip -n "${HOSTS_PREFIX}sw" link set br0 up
  local names="127.0.0.1 localhost"
  for ((i = 0; i < n; ++i)); do names+=$'\n'"10.77.0.$((i + 1)) node$i"; done
  for ((i = 0; i < n; ++i)); do
    local ns
    ns=$(host_ns "$i")
    ip netns add "$ns"
    ip link add "$(host_if "$i")" netns "$ns" type veth peer name "port$i" netns "${HOSTS_PREFIX}sw"
    ip -n "${HOSTS_PREFIX}sw" link set "port$i" master br0
    ip -n "${HOSTS_PREFIX}sw" link set "port$i" up
    ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "$(host_if "$i")"
    ip -n "$ns" link set "$(host_if "$i")" up
    ip -n "$ns" link set lo up
    mkdir -p "/etc/netns/$ns"  # ip netns exec binds these over /etc inside the namespace
    echo "$names" > "/etc/netns/$ns/hosts"
  done
  # The launch agent: `rsh nodeI command...` runs the command on host I (as ssh would, through a
  # shell), under that host's name.
  cat > "$HOSTS_DIR/rsh" <<EOF
#!/bin/sh
host=\$1; shift
exec ip netns exec "${HOSTS_PREFIX}n\${host#node}" unshare --uts sh -c 'hostname "\$0"; exec sh -c "\$1"' "\$host" "\$*"
EOF
  chmod +x "$HOSTS_DIR/rsh"
  HOST_MPI_ARGS="--allow-run-as-root --mca plm_rsh_agent $HOSTS_DIR/rsh --mca btl tcp,self \
--mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 -x OMP_NUM_THREADS"
  # mpirun as a command (for timeout and kuai launch): started on node0 with the options above.
  cat > "$HOSTS_DIR/mpirun" <<EOF
#!/bin/sh
exec ip netns exec "$(host_ns 0)" unshare --uts sh -c 'hostname node0; exec "\$@"' sh "$MPIRUN" $HOST_MPI_ARGS "\$@"
EOF
  chmod +x "$HOSTS_DIR/mpirun"
  HOST_MPIRUN=$HOSTS_DIR/mpirun
}

on_host() {
  local i=$1
  shift
  ip netns exec "$(host_ns "$i")" unshare --uts sh -c 'hostname "$0"; exec "$@"' "node$i" "$@"
}

tx_bytes() {
  ip netns exec "$(host_ns "$1")" cat "/sys/class/net/$(host_if "$1")/statistics/tx_bytes"
}
link_down() { ip -n "$(host_ns "$1")" link set "$(host_if "$1")" down; }
link_up() { ip -n "$(host_ns "$1")" link set "$(host_if "$1")" up; }
host_pids() { ip netns pids "$(host_ns "$1")"; }
