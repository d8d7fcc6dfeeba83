#!/usr/bin/env bash
# Emulated hosts on one machine: network namespaces joined by veth links to a
# bridge, each link limited to a rate (tc tbf) and delayed one way (tc netem),
# so a router and expert nodes can talk over something closer to a network
# than loopback. Needs root (CI runs as root). Sourced by
# scripts/bench_scaleout.sh; also usable by hand:
#
#   sudo bash scripts/cluster_netns.sh up --hosts 3 --rate 25gbit --delay_us 20
#   sudo bash scripts/cluster_netns.sh exec 1 CPU_LIST COMMAND...   # runs in host 1, pinned
#   sudo bash scripts/cluster_netns.sh down
#
# Host i is namespace colibri-h<i> with address 10.77.0.<i+1>/24 on its link
# (host 0 is where the router and the client go). Every packet a host sends
# waits --delay_us once (netem on its link's egress: the one-way delay between
# two hosts) and leaves at most at --rate (tbf). With --delay_us 0 netem is
# not used (only the rate). Refuses clearly, changing nothing, where network
# namespaces, veth, the bridge, tbf or — for a delay — netem are missing (a
# container without CAP_NET_ADMIN, a kernel built without sch_netem).
# `down` removes every namespace and link it made; sourcing scripts call
# netns_down from their exit trap (also on Ctrl-C).
set -euo pipefail

netns_prefix=colibri-h
netns_bridge=colibri-br0

# netns_check RATE DELAY_US: exit 2 with the reason if the pieces are missing.
netns_check() {
  local rate=$1 delay_us=$2 why=""
  if [ "$(id -u)" != 0 ]; then
    why="needs root (network namespaces and tc)"
  elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    why="needs ip and tc (Debian: iproute2)"
  elif ! ip netns add colibri-probe 2>/dev/null; then
    why="cannot create a network namespace here (no CAP_NET_ADMIN, or a kernel without netns)"
  else
    ip netns del colibri-probe
    if ! ip link add colibri-p0 type veth peer name colibri-p1 2>/dev/null; then
      why="cannot create a veth pair (kernel without veth)"
    else
      if ! tc qdisc add dev colibri-p0 root tbf rate "$rate" burst 1mb latency 10ms 2>/dev/null; then
        why="tc tbf (rate limit $rate) is not available in this kernel"
      elif [ "$delay_us" != 0 ] && ! tc qdisc replace dev colibri-p0 root netem delay "${delay_us}us" 2>/dev/null; then
        why="tc netem (the one-way delay) is not available in this kernel (sch_netem); --delay_us 0 runs with the rate limit only"
      fi
      ip link del colibri-p0 2>/dev/null || true
    fi
  fi
  if [ -n "$why" ]; then
    echo "cluster_netns: $why" >&2
    exit 2
  fi
}

# netns_up HOSTS RATE DELAY_US
netns_up() {
  local hosts=$1 rate=$2 delay_us=$3 i
  netns_check "$rate" "$delay_us"
  netns_down
  ip link add "$netns_bridge" type bridge
  ip link set "$netns_bridge" up
  for ((i = 0; i < hosts; i++)); do
    local ns=$netns_prefix$i
    ip netns add "$ns"
    ip link add "cb$i" type veth peer name "ch$i"
    ip link set "cb$i" master "$netns_bridge"
    ip link set "cb$i" up
    ip link set "ch$i" netns "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "ch$i"
    ip -n "$ns" link set "ch$i" up
    # The host's egress: delay (netem) then rate (tbf), or the rate alone.
    if [ "$delay_us" != 0 ]; then
      ip netns exec "$ns" tc qdisc add dev "ch$i" root handle 1: netem delay "${delay_us}us"
      ip netns exec "$ns" tc qdisc add dev "ch$i" parent 1: handle 2: tbf rate "$rate" burst 1mb latency 10ms
    else
      ip netns exec "$ns" tc qdisc add dev "ch$i" root tbf rate "$rate" burst 1mb latency 10ms
    fi
  done
}

# netns_exec HOST CPU_LIST COMMAND...: COMMAND in that host's namespace, pinned.
netns_exec() {
  local host=$1 cpus=$2
  shift 2
  exec ip netns exec "$netns_prefix$host" taskset -c "$cpus" "$@"
}

netns_down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$netns_prefix" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$netns_bridge" 2>/dev/null || true
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  command=${1:-}
  shift || true
  case "$command" in
    up)
      hosts=3 rate=25gbit delay_us=20
      while [ $# -gt 0 ]; do
        case "$1" in
          --hosts) hosts=$2; shift 2 ;;
          --rate) rate=$2; shift 2 ;;
          --delay_us) delay_us=$2; shift 2 ;;
          *) echo "cluster_netns: unknown argument $1" >&2; exit 2 ;;
        esac
      done
      netns_up "$hosts" "$rate" "$delay_us"
      echo "cluster_netns: $hosts hosts (10.77.0.1-$hosts), $rate, ${delay_us} us one way"
      ;;
    exec) [ $# -ge 3 ] || { echo "usage: cluster_netns.sh exec HOST CPU_LIST COMMAND..." >&2; exit 2; }
      netns_exec "$@" ;;
    down) netns_down ;;
    check) netns_check "${1:-25gbit}" "${2:-20}"; echo "cluster_netns: namespaces, veth, tbf and netem available" ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
  esac
fi
