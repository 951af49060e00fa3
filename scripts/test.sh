#!/usr/bin/env bash
# Runs iop's whole test suite: unit, property and real-process tests, including the
# official client libraries against `iop demo` and test edges: the `openai`, `anthropic` and
# `ollama` Python packages (pinned in crates/iop/tests/python/requirements.txt, installed into .venv),
# the OpenAI Node SDK and the coding agents Claude Code and Codex (pinned by
# crates/iop/tests/node/package-lock.json, installed into that directory's node_modules),
# and aider (pinned in crates/iop/tests/python/aider-requirements.txt, into .venv-aider).
# Each is installed again when its pins change.
#
# The conformance suite against a real llama.cpp server runs when IOP_LLAMA_SERVER and
# IOP_LLAMA_MODEL are set: `eval "$(scripts/real-backend.sh)"` first.
set -euo pipefail
cd "$(dirname "$0")/.."

# What a fresh machine may lack for the tests: curl, Python's venv module (the pinned client
# libraries), Node.js and npm (the OpenAI Node SDK and the agents), Chromium (the status
# page's test), PostgreSQL's server binaries (the shared-store tests start their own),
# HAProxy (the rolling-restart test puts it in front of a fleet of edges).
# Installed with apt-get when running as root; otherwise the missing ones are named.
missing=()
command -v curl >/dev/null || missing+=(curl)
command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || [ -n "${IOP_PG_BIN:-}" ] || missing+=(postgresql)
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || [ -n "${IOP_HAPROXY:-}" ] || missing+=(haproxy)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    else
        echo "scripts/test.sh: please install: ${missing[*]}" >&2
        exit 1
    fi
fi
export IOP_REQUIRE_BROWSER=1
# The store tests start a PostgreSQL server of their own from these binaries, and an
# HAProxy in front of their edges.
export IOP_REQUIRE_POSTGRES=1
export IOP_REQUIRE_HAPROXY=1

requirements=crates/iop/tests/python/requirements.txt
if [ ! -x .venv/bin/python ] || ! cmp -s "$requirements" .venv/iop-requirements.txt; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check -r "$requirements"
    cp "$requirements" .venv/iop-requirements.txt
fi
export IOP_PYTHON="$PWD/.venv/bin/python"
export IOP_REQUIRE_PYTHON_SDK=1

# aider, in an environment of its own (it pins its own versions of the SDKs).
aider_requirements=crates/iop/tests/python/aider-requirements.txt
if [ ! -x .venv-aider/bin/aider ] || ! cmp -s "$aider_requirements" .venv-aider/iop-requirements.txt; then
    python3 -m venv .venv-aider
    .venv-aider/bin/pip install --quiet --disable-pip-version-check -r "$aider_requirements"
    cp "$aider_requirements" .venv-aider/iop-requirements.txt
fi
export IOP_AIDER="$PWD/.venv-aider/bin/aider"

node_dir=crates/iop/tests/node
if ! cmp -s "$node_dir/package-lock.json" "$node_dir/node_modules/iop-package-lock.json"; then
    npm ci --prefix "$node_dir" --no-audit --no-fund --loglevel=error
    cp "$node_dir/package-lock.json" "$node_dir/node_modules/iop-package-lock.json"
fi
export IOP_NODE_SDK_DIR="$PWD/$node_dir"
export IOP_REQUIRE_NODE_SDK=1

cargo test --workspace "$@"
