#!/usr/bin/env bash
# Measures a fleet: three edges sharing a PostgreSQL store (started here, from Debian's
# binaries) and NODES nodes (default 100), each node linked to every edge. Prints each
# edge's resident memory with no node and with every node linked, the memory per link,
# and how long after a fourth edge starts every node is ready on it.
#
#   scripts/bench-fleet.sh            # 100 nodes
#   NODES=20 scripts/bench-fleet.sh
set -euo pipefail
cd "$(dirname "$0")/.."

NODES=${NODES:-100}
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
export IOP_STORE_SECRET_KEY=MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=

start_pg 15433 max_connections=200

nodes_yaml=""
for i in $(seq "$NODES"); do
    nodes_yaml+="  - {id: n$i, token: token-n$i-0123456789, providers: [{id: m, kind: mock}]}
"
done

# start_edge N: edge-N on 127.0.0.1:1770N (nodes) and :1880N (HTTP).
start_edge() {
    local n=$1
    cat >"$WORK/edge-$n.yaml" <<YAML
listen: {nodes: "127.0.0.1:1770$n", http: "127.0.0.1:1880$n"}
state_dir: "$WORK/edge-$n-state"
store: {url: "$STORE_URL", edge_id: edge-$n}
nodes:
$nodes_yaml
model_groups:
  - {name: mock, members: [{node: n1, provider: m}]}
YAML
    RUST_LOG=warn "$IOP" edge --config "$WORK/edge-$n.yaml" >"$WORK/edge-$n.log" 2>&1 &
    PIDS+=($!)
    EDGE_PID[$n]=$!
    wait_for "http://127.0.0.1:1880$n/healthz"
}

# ready N: how many nodes edge-N has dispatch-ready.
ready() {
    curl -sf "http://127.0.0.1:1880$1/admin/status" |
        python3 -c 'import json,sys; print(sum(1 for n in json.load(sys.stdin)["nodes"] if n.get("ready")))'
}

rss_kb() { ps -o rss= -p "$1" | tr -d ' '; }

declare -A EDGE_PID
for n in 1 2 3; do start_edge "$n"; done
sleep 3
declare -A IDLE
for n in 1 2 3; do IDLE[$n]=$(rss_kb "${EDGE_PID[$n]}"); done

pin=$(RUST_LOG=warn "$IOP" edge --config "$WORK/edge-1.yaml" --print-pin)
for i in $(seq "$NODES"); do
    RUST_LOG=warn "$IOP" node --edge 127.0.0.1:17701 --token "token-n$i-0123456789" \
        --edge-pin "$pin" --db "$WORK/n$i.db" --state-file "$WORK/n$i.json" \
        >"$WORK/n$i.log" 2>&1 &
    PIDS+=($!)
done
for _ in $(seq 600); do
    [ "$(ready 1)" = "$NODES" ] && [ "$(ready 2)" = "$NODES" ] && [ "$(ready 3)" = "$NODES" ] && break
    sleep 0.2
done
sleep 3
echo "| edge | nodes linked | RSS idle (MiB) | RSS with links (MiB) | per link (KiB) |"
echo "|---|---:|---:|---:|---:|"
for n in 1 2 3; do
    linked=$(ready "$n")
    with=$(rss_kb "${EDGE_PID[$n]}")
    per=$(( (with - IDLE[$n]) / (linked > 0 ? linked : 1) ))
    awk -v n="$n" -v linked="$linked" -v idle="${IDLE[$n]}" -v with="$with" -v per="$per" \
        'BEGIN { printf "| edge-%s | %s | %.1f | %.1f | %s |\n", n, linked, idle / 1024, with / 1024, per }'
done
node_rss=$(ps -o rss= -p "${PIDS[-1]}" | tr -d ' ')
echo
echo "one node's RSS with 3 links: $((node_rss / 1024)) MiB"

# A fourth edge: how long until every node is ready on it.
start=$(date +%s.%N)
start_edge 4
for _ in $(seq 600); do
    [ "$(ready 4)" = "$NODES" ] && break
    sleep 0.05
done
end=$(date +%s.%N)
awk -v nodes="$NODES" -v start="$start" -v end="$end" -v ready="$(ready 4)" \
    'BEGIN { printf "\nall %s nodes ready on a newly started edge: %.2f s after its start (ready: %s)\n", nodes, end - start, ready }'
