#!/usr/bin/env bash
# Benchmarks the relay: the same chat completions sent straight to `iop mock-provider`
# and through `iop edge` + `iop node` (raw tunnel) in one interleaved run.
#
#   scripts/bench.sh [extra iop bench flags, e.g. --requests 5000 --concurrency 8]
#   MOCK_ARGS="--token-delay-ms 5" scripts/bench.sh --mode stream   # paced tokens
#   IOP_BENCH_LINK=both scripts/bench.sh      # direct vs plaintext vs TLS node link
#   IOP_BENCH_BASELINE=/path/to/older/iop scripts/bench.sh   # before/after in one run
#   IOP_BENCH_BASELINE="v1=/path/a v2=/path/b" scripts/bench.sh   # several, named
#   IOP_BENCH_LEDGER=both scripts/bench.sh    # direct vs usage ledger off vs on
#   IOP_BENCH_STORE=both scripts/bench.sh     # direct vs an edge alone vs one with a store
#   IOP_BENCH_ROUTER=/path/to/vllm-router scripts/bench.sh  # and a one-hop router, same run
#
# IOP_BENCH_LINK picks the edge–node link: `tls` (the default, what users get),
# `plaintext` (node_tls.mode insecure_plaintext), or `both` (two edge + node pairs, one per
# link, measured in the same interleaved run: targets `plaintext` and `tls`).
#
# IOP_BENCH_BASELINE names another `iop` binary (e.g. a release build of an earlier commit),
# or several as space-separated NAME=PATH words: each runs one more edge + node pair
# (target `baseline`, or NAME), in the same interleaved run, with a
# config that older versions read too (no TLS settings: a version with TLS uses its
# default, the pinned TLS link).
#
# IOP_BENCH_LEDGER turns the edge's usage ledger `on` (the default, what users get) or
# `off` (ledger.enabled: false), or `both`: two edge + node pairs on the chosen link, one
# without and one with the ledger, in the same interleaved run (targets `ledger-off` and
# `ledger-on`). scripts/bench-ledger.sh measures the ledger's own write throughput.
#
# IOP_BENCH_STORE=both starts a PostgreSQL server of its own (Debian's binaries, as the
# tests do) and two edge + node pairs: `store-off` (an edge alone) and `store-on` (an edge
# of a fleet on that store). Requests carry an API key with requests_per_minute and
# max_concurrent limits far above what the run sends, so every request is admitted by
# the limiter: this edge's own, or the fleet's in the store. IOP_BENCH_KEY_LIMITS=off
# gives the key no limits (the store is then off the request path).
#
# Builds release binaries, starts the processes on loopback ports, prints the tables
# `iop bench` produces (latency and throughput per target, and the CPU time and context
# switches per request of each target's own processes: its edge and node, or the router)
# and stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh

LINK=${IOP_BENCH_LINK:-tls}
LEDGER=${IOP_BENCH_LEDGER:-on}
STORE=${IOP_BENCH_STORE:-off}
STORE_URL=""
AUTH_YAML=""
BENCH_KEY=sk-bench-key-0123456789
MOCK_PORT=${MOCK_PORT:-18000}
NODE_PORT=${NODE_PORT:-17700}
HTTP_PORT=${HTTP_PORT:-18080}

case "$LINK" in
    tls | plaintext | both) ;;
    *) echo "IOP_BENCH_LINK must be tls, plaintext or both (got $LINK)" >&2; exit 2 ;;
esac
case "$LEDGER" in
    on | off | both) ;;
    *) echo "IOP_BENCH_LEDGER must be on, off or both (got $LEDGER)" >&2; exit 2 ;;
esac
if [ "$LINK" = both ] && [ "$LEDGER" = both ]; then
    echo "compare either the links or the ledger in one run, not both" >&2
    exit 2
fi

# shellcheck disable=SC2086 # MOCK_ARGS is a list of flags
"$IOP" mock-provider --listen "127.0.0.1:$MOCK_PORT" --tokens 16 ${MOCK_ARGS:-} >"$WORK/mock.log" 2>&1 &
PIDS+=($!)

TARGETS=(--target "direct=http://127.0.0.1:$MOCK_PORT/v1")
# The processes serving each target but the direct one, whose CPU and context switches
# per request `iop bench` reports (the mock serves every target: it is left out).
CPU_ARGS=()

# start_pair NAME LINK NODE_PORT HTTP_PORT [LEDGER] [STORE]: an edge and a node whose link
# is LINK, the edge's usage ledger on or off (default: $LEDGER), in a fleet on $STORE_URL
# when STORE is on.
start_pair() {
    local name=$1 link=$2 node_port=$3 http_port=$4 ledger=${5:-$LEDGER} store=${6:-off}
    local store_yaml=""
    [ "$store" = on ] && store_yaml="store: {url: \"$STORE_URL\", edge_id: $name}"
    local ledger_enabled=true
    [ "$ledger" = off ] && ledger_enabled=false
    local mode=auto node_args=()
    if [ "$link" = plaintext ]; then
        mode=insecure_plaintext
        node_args=(--insecure-plaintext)
    fi
    cat >"$WORK/$name.yaml" <<YAML
listen: {nodes: "127.0.0.1:$node_port", http: "127.0.0.1:$http_port"}
state_dir: "$WORK/$name-state"
node_tls: {mode: $mode}
ledger: {enabled: $ledger_enabled}
$store_yaml
$AUTH_YAML
nodes:
  - id: bench
    token: bench-token-0123456789
    providers:
      - {id: mock, kind: openai_compat, base_url: "http://127.0.0.1:$MOCK_PORT/v1", capacity: {normal: 64, long: 0}}
model_groups:
  - {name: mock-model, members: [{node: bench, provider: mock}], queue: {max_waiting: 1024}}
YAML
    if [ "$link" = tls ]; then
        node_args=(--edge-pin "$(IOP_STORE_SECRET_KEY=MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY= \
            RUST_LOG=warn "$IOP" edge --config "$WORK/$name.yaml" --print-pin)")
    fi
    IOP_STORE_SECRET_KEY=MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY= RUST_LOG=warn \
        "$IOP" edge --config "$WORK/$name.yaml" >"$WORK/$name-edge.log" 2>&1 &
    PIDS+=($!)
    local edge_pid=$!
    sleep 0.5
    RUST_LOG=warn "$IOP" node --edge "127.0.0.1:$node_port" --token bench-token-0123456789 \
        --db "$WORK/$name-node.db" --state-file "$WORK/$name-node.json" "${node_args[@]}" \
        >"$WORK/$name-node.log" 2>&1 &
    PIDS+=($!)
    CPU_ARGS+=(--cpu "$name=$edge_pid,$!")
    wait_for "http://127.0.0.1:$http_port/readyz"
    TARGETS+=(--target "$name=http://127.0.0.1:$http_port/v1")
}

# start_baseline NAME BIN NODE_PORT HTTP_PORT: an edge and a node run by the binary BIN.
start_baseline() {
    local name=$1 bin=$2 node_port=$3 http_port=$4 pin_args=()
    local dir="$WORK/$name"
    mkdir -p "$dir"
    cat >"$dir/edge.yaml" <<YAML
listen: {nodes: "127.0.0.1:$node_port", http: "127.0.0.1:$http_port"}
nodes:
  - id: bench
    token: bench-token-0123456789
    providers:
      - {id: mock, kind: openai_compat, base_url: "http://127.0.0.1:$MOCK_PORT/v1", capacity: {normal: 64, long: 0}}
model_groups:
  - {name: mock-model, members: [{node: bench, provider: mock}], queue: {max_waiting: 1024}}
YAML
    local pin
    if pin=$(RUST_LOG=warn "$bin" edge --config "$dir/edge.yaml" --print-pin 2>/dev/null); then
        pin_args=(--edge-pin "$pin")
    fi
    RUST_LOG=warn "$bin" edge --config "$dir/edge.yaml" >"$WORK/$name-edge.log" 2>&1 &
    PIDS+=($!)
    local edge_pid=$!
    sleep 0.5
    (cd "$dir" && RUST_LOG=warn exec "$bin" node --edge "127.0.0.1:$node_port" \
        --token bench-token-0123456789 --db "$dir/node.db" "${pin_args[@]}") \
        >"$WORK/$name-node.log" 2>&1 &
    PIDS+=($!)
    CPU_ARGS+=(--cpu "$name=$edge_pid,$!")
    wait_for "http://127.0.0.1:$http_port/readyz"
    TARGETS+=(--target "$name=http://127.0.0.1:$http_port/v1")
}

baseline_port=2
for entry in ${IOP_BENCH_BASELINE:-}; do
    case "$entry" in
        *=*) name=${entry%%=*} bin=${entry#*=} ;;
        *) name=baseline bin=$entry ;;
    esac
    start_baseline "$name" "$bin" "$((NODE_PORT + baseline_port))" "$((HTTP_PORT + baseline_port))"
    baseline_port=$((baseline_port + 1))
done

# A one-hop router in front of the same mock, for comparison (vllm-router: a Rust router
# with a Python launcher, `pip install vllm-router`).
if [ -n "${IOP_BENCH_ROUTER:-}" ]; then
    router_port=$((HTTP_PORT + 20))
    "$IOP_BENCH_ROUTER" --host 127.0.0.1 --port "$router_port" \
        --worker-urls "http://127.0.0.1:$MOCK_PORT" --policy round_robin \
        --disable-retries --disable-circuit-breaker --log-level warning \
        >"$WORK/router.log" 2>&1 &
    PIDS+=($!)
    CPU_ARGS+=(--cpu "vllm-router=$!")
    wait_for "http://127.0.0.1:$router_port/health" 300
    TARGETS+=(--target "vllm-router=http://127.0.0.1:$router_port/v1")
fi

BENCH_ARGS=()
if [ "$STORE" = both ]; then
    start_pg 15432 synchronous_commit=off
    limits="limits: {requests_per_minute: 1000000, max_concurrent: 100000}"
    [ "${IOP_BENCH_KEY_LIMITS:-on}" = off ] && limits="limits: {}"
    AUTH_YAML="auth: {keys: [{name: bench, role: admin, key: $BENCH_KEY, $limits}]}"
    BENCH_ARGS=(--api-key "$BENCH_KEY")
    start_pair store-off "$LINK" "$NODE_PORT" "$HTTP_PORT" "$LEDGER" off
    start_pair store-on "$LINK" "$((NODE_PORT + 1))" "$((HTTP_PORT + 1))" "$LEDGER" on
elif [ "$LINK" = both ]; then
    start_pair plaintext plaintext "$NODE_PORT" "$HTTP_PORT"
    start_pair tls tls "$((NODE_PORT + 1))" "$((HTTP_PORT + 1))"
elif [ "$LEDGER" = both ]; then
    start_pair ledger-off "$LINK" "$NODE_PORT" "$HTTP_PORT" off
    start_pair ledger-on "$LINK" "$((NODE_PORT + 1))" "$((HTTP_PORT + 1))" on
else
    start_pair iop "$LINK" "$NODE_PORT" "$HTTP_PORT"
fi

"$IOP" bench "${TARGETS[@]}" "${CPU_ARGS[@]}" --model mock-model "${BENCH_ARGS[@]}" "$@"
if [ -n "$STORE_URL" ]; then
    "${AT_EXIT[@]}" >/dev/null
    AT_EXIT=()
fi
if [ "$LEDGER" != off ]; then
    for log in "$WORK"/*-edge.log; do
        grep -h "records dropped" "$log" && echo "WARNING: the ledger dropped records in $log" >&2
    done
    true
fi
