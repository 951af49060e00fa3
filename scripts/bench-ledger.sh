#!/usr/bin/env bash
# Measures the usage ledger's sustained write throughput on this machine: RECORDS records
# (default 200000) pushed as fast as one thread can into a ledger on a fresh SQLite file,
# timed until the writer committed the last one. Prints records/s.
#
#   scripts/bench-ledger.sh
#   IOP_LEDGER_BENCH_RECORDS=1000000 scripts/bench-ledger.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release --quiet -p iop-edge --lib ledger::tests::write_throughput \
    -- --ignored --nocapture --exact 2>&1 | grep -E "ledger write throughput|panicked|FAILED"
