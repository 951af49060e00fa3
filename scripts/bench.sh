#!/usr/bin/env bash
# Benchmarks the relay: the same chat completions sent straight to `iop mock-provider`
# and through `iop edge` + `iop node` (raw tunnel) in one interleaved run.
#
#   scripts/bench.sh [extra iop bench flags, e.g. --requests 5000 --concurrency 8]
#   MOCK_ARGS="--token-delay-ms 5" scripts/bench.sh --mode stream   # paced tokens
#
# Builds release binaries, starts the three processes on loopback ports, prints the
# table `iop bench` produces and stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --quiet --bin iop
IOP="$PWD/target/release/iop"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

MOCK_PORT=${MOCK_PORT:-18000}
NODE_PORT=${NODE_PORT:-17700}
HTTP_PORT=${HTTP_PORT:-18080}

# shellcheck disable=SC2086 # MOCK_ARGS is a list of flags
"$IOP" mock-provider --listen "127.0.0.1:$MOCK_PORT" --tokens 16 ${MOCK_ARGS:-} >"$WORK/mock.log" 2>&1 &
PIDS+=($!)
cat >"$WORK/edge.yaml" <<YAML
listen: {nodes: "127.0.0.1:$NODE_PORT", http: "127.0.0.1:$HTTP_PORT"}
nodes:
  - id: bench
    token: bench-token-0123456789
    providers:
      - {id: mock, kind: openai_compat, base_url: "http://127.0.0.1:$MOCK_PORT/v1", capacity: {normal: 64, long: 0}}
model_groups:
  - {name: mock-model, members: [{node: bench, provider: mock}], queue: {max_waiting: 1024}}
YAML
RUST_LOG=warn "$IOP" edge --config "$WORK/edge.yaml" >"$WORK/edge.log" 2>&1 &
PIDS+=($!)
sleep 0.5
RUST_LOG=warn "$IOP" node --edge "127.0.0.1:$NODE_PORT" --token bench-token-0123456789 --db "$WORK/node.db" >"$WORK/node.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null && break
    sleep 0.1
done

"$IOP" bench \
    --target "direct=http://127.0.0.1:$MOCK_PORT/v1" \
    --target "iop=http://127.0.0.1:$HTTP_PORT/v1" \
    --model mock-model "$@"
