#!/usr/bin/env bash
# Benchmarks cache-affine routing: multi-turn conversations sharing a few long system
# prompts, sent through one edge + node to three model groups that differ only in their
# `routing:` policy, each over MEMBERS mock providers of its own that model a prefix (KV)
# cache (time to first token = base + a cost per uncached prompt token, an LRU of prompt
# blocks per mock).
#
#   scripts/bench-affinity.sh [extra iop bench flags, e.g. --sessions 128 --turns 10]
#   MEMBERS=4 scripts/bench-affinity.sh
#   MOCK_ARGS="--prefix-cache-blocks 4096" scripts/bench-affinity.sh
#
# Targets, interleaved round by round: `least` (least_in_flight), `session` (session) and
# `session+prefix` (session_prefix, the default). Half of the conversations name their
# session (prompt_cache_key); the other half send their prompt alone. After the run each
# mock's peak of requests in flight is printed per group, to show no member was loaded
# past the others.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh

MEMBERS=${MEMBERS:-8}
BASE_PORT=${MOCK_PORT:-18100}
NODE_PORT=${NODE_PORT:-17750}
HTTP_PORT=${HTTP_PORT:-18090}
# A KV cache of 2048 blocks of 16 tokens (32k tokens: about four conversations) per member, 20 ms base, 250 us
# per uncached token (a 2,000-token prompt prefills in 0.5 s), 8 output tokens 5 ms apart.
DEFAULT_MOCK="--prefix-cache-blocks 2048 --prefill-base-ms 20 --prefill-us-per-token 250 --tokens 8 --token-delay-ms 5"

POLICIES=(least_in_flight session session_prefix)
NAMES=(least session session+prefix)
PROVIDERS=""
GROUPS_YAML=""
port=$BASE_PORT
for p in "${POLICIES[@]}"; do
    members=""
    for i in $(seq 1 "$MEMBERS"); do
        # shellcheck disable=SC2086 # flag lists
        "$IOP" mock-provider --listen "127.0.0.1:$port" $DEFAULT_MOCK ${MOCK_ARGS:-} \
            >"$WORK/mock-$p-$i.log" 2>&1 &
        PIDS+=($!)
        PROVIDERS+="      - {id: $p-$i, kind: openai_compat, base_url: \"http://127.0.0.1:$port/v1\", capacity: {normal: 32, long: 0}}
"
        members+="{node: bench, provider: $p-$i, model: m}, "
        port=$((port + 1))
    done
    GROUPS_YAML+="  - {name: chat-$p, routing: $p, members: [${members%, }], queue: {max_waiting: 1024}}
"
done

cat >"$WORK/edge.yaml" <<YAML
listen: {nodes: "127.0.0.1:$NODE_PORT", http: "127.0.0.1:$HTTP_PORT"}
state_dir: "$WORK/edge-state"
node_tls: {mode: insecure_plaintext}
nodes:
  - id: bench
    token: bench-token-0123456789
    providers:
$PROVIDERS
model_groups:
$GROUPS_YAML
YAML
RUST_LOG=warn "$IOP" edge --config "$WORK/edge.yaml" >"$WORK/edge.log" 2>&1 &
PIDS+=($!)
sleep 0.5
RUST_LOG=warn "$IOP" node --edge "127.0.0.1:$NODE_PORT" --token bench-token-0123456789 \
    --db "$WORK/node.db" --state-file "$WORK/node.json" --insecure-plaintext \
    >"$WORK/node.log" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$HTTP_PORT/readyz"

TARGETS=()
for i in "${!POLICIES[@]}"; do
    TARGETS+=(--target "${NAMES[$i]}=http://127.0.0.1:$HTTP_PORT/v1#chat-${POLICIES[$i]}")
done
"$IOP" bench --scenario sessions --concurrency 16 --rounds 4 --turns 10 "${TARGETS[@]}" "$@"

echo
echo "peak requests in flight per member:"
port=$BASE_PORT
for p in "${POLICIES[@]}"; do
    peaks=""
    for _ in $(seq 1 "$MEMBERS"); do
        peaks+="$(curl -sf "http://127.0.0.1:$port/mock/stats" | sed -n 's/.*"peak_in_flight":\([0-9]*\).*/\1/p') "
        port=$((port + 1))
    done
    echo "  chat-$p: $peaks"
done
