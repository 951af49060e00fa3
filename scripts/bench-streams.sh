#!/usr/bin/env bash
# How many concurrent streams one edge holds with its default settings, and what each
# costs: for each count N (default 5000 10000 15000) N streamed chat completions are opened
# through `iop edge` + `iop node` to `iop mock-provider`, and the script reports how
# many completed, first byte and end p50/p99, and the edge's and node's peak memory above
# idle, per stream. The streams are opened evenly over RAMP_MS (default: N ms, a thousand
# a second) and each lasts about 32 s (32 tokens, 1 s apart), so all N are open together;
# "open" is the most the client had open at once.
#
#   scripts/bench-streams.sh [N ...]
#
# The edge config sets only what the run needs (two providers of 10000 slots on the mock); the HTTP
# connection cap is the edge's default, derived from its open-files limit.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
COUNTS=("$@")
[ ${#COUNTS[@]} -eq 0 ] && COUNTS=(5000 10000 15000)
MOCK_PORT=${MOCK_PORT:-18200}
NODE_PORT=${NODE_PORT:-17760}
HTTP_PORT=${HTTP_PORT:-18095}
ulimit -n "$(ulimit -Hn)"

"$IOP" mock-provider --listen "127.0.0.1:$MOCK_PORT" --tokens 32 --token-delay-ms 1000 >"$WORK/mock.log" 2>&1 &
PIDS+=($!)
cat >"$WORK/edge.yaml" <<YAML
listen: {nodes: "127.0.0.1:$NODE_PORT", http: "127.0.0.1:$HTTP_PORT"}
state_dir: "$WORK/edge-state"
nodes:
  - id: bench
    token: bench-token-0123456789
    providers:
      - {id: mock-a, kind: openai_compat, base_url: "http://127.0.0.1:$MOCK_PORT/v1", capacity: {normal: 10000, long: 0}}
      - {id: mock-b, kind: openai_compat, base_url: "http://127.0.0.1:$MOCK_PORT/v1", capacity: {normal: 10000, long: 0}}
model_groups:
  - {name: mock-model, members: [{node: bench, provider: mock-a}, {node: bench, provider: mock-b}]}
YAML
PIN=$(RUST_LOG=warn "$IOP" edge --config "$WORK/edge.yaml" --print-pin)
RUST_LOG=info "$IOP" edge --config "$WORK/edge.yaml" >"$WORK/edge.log" 2>&1 &
EDGE=$!
PIDS+=($EDGE)
sleep 0.5
RUST_LOG=warn "$IOP" node --edge "127.0.0.1:$NODE_PORT" --token bench-token-0123456789 \
    --db "$WORK/node.db" --state-file "$WORK/node.json" --edge-pin "$PIN" >"$WORK/node.log" 2>&1 &
NODE=$!
PIDS+=($NODE)
wait_for "http://127.0.0.1:$HTTP_PORT/readyz"
grep -o 'max_connections=[0-9]*' "$WORK/edge.log" | head -1 | sed 's/^/edge default: /'

rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
echo "| streams | completed | refused | failed | open | first byte p50 ms | first byte p99 ms | end p50 ms | end p99 ms | edge KiB/stream | node KiB/stream | edge idle MiB |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for n in "${COUNTS[@]}"; do
    sleep 2
    edge_idle=$(rss_kb $EDGE)
    node_idle=$(rss_kb $NODE)
    : >"$WORK/peaks"
    (
        while true; do
            echo "$(rss_kb $EDGE) $(rss_kb $NODE)" >>"$WORK/peaks"
            sleep 0.2
        done
    ) &
    SAMPLER=$!
    "$IOP" bench --scenario streams --requests "$n" --ramp-ms "${RAMP_MS:-$n}" --json \
        --target "edge=http://127.0.0.1:$HTTP_PORT/v1" >"$WORK/run.json"
    kill $SAMPLER
    read -r edge_peak node_peak < <(awk '$1 > a {a = $1} $2 > b {b = $2} END {print a + 0, b + 0}' "$WORK/peaks")
    python3 - "$WORK/run.json" "$n" "$edge_idle" "$edge_peak" "$node_idle" "$node_peak" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
n, ei, ep, ni, np_ = (int(x) for x in sys.argv[2:])
print(f"| {n} | {r['completed']} | {r['refused']} | {r['failed']} | {r['peak_open']} | {r['first_byte_p50_ms']:.1f} | "
      f"{r['first_byte_p99_ms']:.1f} | {r['done_p50_ms']:.0f} | {r['done_p99_ms']:.0f} | "
      f"{(ep - ei) / n:.1f} | {(np_ - ni) / n:.1f} | {ei / 1024:.1f} |")
PY
done
