# Sourced by the benchmark scripts, from the repository root: builds the release `iop`
# ($IOP), makes a scratch directory ($WORK) and, on exit, stops every process in PIDS,
# runs the command in AT_EXIT if one was set, and removes $WORK.

cargo build --release --quiet --bin iop
IOP="$PWD/target/release/iop"
WORK=$(mktemp -d)
PIDS=()
AT_EXIT=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    # Whatever it answers, $WORK still goes (under `set -e` a failing last command of an
    # `&&` list would end the trap here).
    if [ ${#AT_EXIT[@]} -gt 0 ]; then "${AT_EXIT[@]}" >/dev/null 2>&1 || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# wait_for URL [TRIES]: returns once URL answers with a success status, trying every
# 0.1 s, at most TRIES times (default 100: 10 s).
wait_for() {
    for _ in $(seq "${2:-100}"); do
        curl -sf "$1" >/dev/null && return 0
        sleep 0.1
    done
}

# start_pg PORT [SETTING ...]: a PostgreSQL server of its own (Debian's binaries, as the
# tests run it) in $WORK/pg on 127.0.0.1:PORT with a database `iop` of user `iop`, each
# SETTING (`name=value`) a server setting; stopped on exit (AT_EXIT). Sets STORE_URL.
start_pg() {
    local port=$1 bin run=() options
    shift
    options="-p $port -k $WORK/pg -c listen_addresses=127.0.0.1 -c fsync=off"
    for setting in "$@"; do options+=" -c $setting"; done
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
    mkdir -p "$WORK/pg"
    if [ "$(id -u)" = 0 ]; then
        chown postgres "$WORK" "$WORK/pg"
        run=(runuser -u postgres --)
    fi
    "${run[@]}" "$bin/initdb" -D "$WORK/pg/data" -A trust -U iop --no-sync >/dev/null
    "${run[@]}" "$bin/pg_ctl" -D "$WORK/pg/data" -l "$WORK/pg/log" -w -o "$options" start >/dev/null
    "${run[@]}" "$bin/createdb" -h 127.0.0.1 -p "$port" -U iop iop
    AT_EXIT=("${run[@]}" "$bin/pg_ctl" -D "$WORK/pg/data" -m immediate stop)
    STORE_URL="postgres://iop@127.0.0.1:$port/iop"
}
