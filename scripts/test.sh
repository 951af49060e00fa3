#!/usr/bin/env bash
# Runs iop's whole test suite: unit, property and real-process tests, including the
# official `openai` and `anthropic` Python SDKs against `iop demo` and the official `ollama`
# Python client against a test edge (all installed into .venv on first run).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import openai, anthropic, ollama' 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check openai anthropic ollama
fi
export IOP_PYTHON="$PWD/.venv/bin/python"
export IOP_REQUIRE_PYTHON_SDK=1

cargo test --workspace "$@"
