#!/usr/bin/env bash
# A Colibri cluster on one host, without containers: one expert node per
# socket (NUMA node) — pinned with numactl when it is installed, and bound by
# the node itself (--numa_node) either way — with the experts split evenly
# between them, and a router in front. Ctrl-C (or SIGTERM) stops everything.
#
# Usage: deploy/examples/run-local.sh --model DIR [--nodes N] [--router_port 50051]
#          [--base_port 50061] [--bin DIR] [--ready_only]
#   --nodes N      expert nodes (default: one per NUMA node of this host)
#   ports 0        pick free ports (--router_port 0 --base_port 0)
#   --ready_only   start, wait until the router serves every expert, print the
#                  cluster status, stop (what tests/cli/deploy_examples.sh runs)
# The model's experts per layer come from its manifest.json.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
model="" nodes="" router_port=50051 base_port=50061 ready_only=0
bin=${COLIBRI_BUILD_DIR:-$root/build}
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --router_port) router_port=$2; shift 2 ;;
    --base_port) base_port=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --ready_only) ready_only=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "run-local: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -f "$model/manifest.json" ] || { echo "run-local: --model must be a converted model directory" >&2; exit 2; }
sockets=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
[ "$sockets" -ge 1 ] || sockets=1
nodes=${nodes:-$sockets}
# Every expert, the shared ones (ids n_experts and up) included, is split over the nodes.
experts=$(/usr/bin/python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))
print(m["n_experts"] + m.get("shared_experts", {}).get("count", 0))' "$model/manifest.json")
[ "$nodes" -le "$experts" ] || { echo "run-local: more nodes ($nodes) than experts ($experts)" >&2; exit 2; }

find_bin() { for d in "$bin/expert_node" "$bin/router_node" "$bin"; do [ -x "$d/$1" ] && { echo "$d/$1"; return; }; done; command -v "$1"; }
expert_bin=$(find_bin colibri-expert)
router_bin=$(find_bin colibri-router)
source "$root/scripts/process_lib.sh"
proc_init

addresses=()
for ((i = 0; i < nodes; ++i)); do
  first=$((i * experts / nodes)); last=$(((i + 1) * experts / nodes - 1))
  socket=$((i % sockets))
  pin=()
  if command -v numactl >/dev/null && [ "$sockets" -gt 1 ]; then
    pin=(numactl --cpunodebind="$socket" --membind="$socket")
  fi
  numa=()
  [ "$sockets" -gt 1 ] && numa=(--numa_node "$socket")
  proc_start "expert_$i" "${pin[@]}" "$expert_bin" --model "$model" --experts "$first-$last" "${numa[@]}" \
    --listen "127.0.0.1:$([ "$base_port" = 0 ] && echo 0 || echo $((base_port + i)))"
  echo "expert node $i: experts $first-$last, socket $socket, 127.0.0.1:$port"
  addresses+=("127.0.0.1:$port")
done
proc_start router "$router_bin" --model "$model" --experts_at "$(IFS=,; echo "${addresses[*]}")" \
  --listen "127.0.0.1:$router_port"
router_port=$port
echo "router: 127.0.0.1:$router_port in front of ${#addresses[@]} expert node(s)"
serving() {
  /usr/bin/python3 "$root/scripts/router_client.py" --router "127.0.0.1:$router_port" status > "$proc_logs/status" 2>&1
  grep -q '"serving": true' "$proc_logs/status"
}
for _ in $(seq 1 100); do serving && break; sleep 0.1; done
serving || { cat "$proc_logs/status" >&2; echo "run-local: the router does not serve every expert" >&2; exit 1; }
echo "serving every expert of every layer"
[ "$ready_only" = 1 ] && exit 0
echo "Ctrl-C stops the cluster."
wait
