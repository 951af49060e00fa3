#!/usr/bin/env bash
# Provides a real inference server for iop's conformance suite (crates/iop/tests/conformance.rs):
# llama.cpp's `llama-server`, built from the pinned llama-cpp-python source distribution (the
# llama.cpp sources are vendored inside it), and a tiny random-weight GGUF model made by
# scripts/tiny_gguf.py. Both are cached outside the work tree, so only the first run builds
# (10-20 minutes on 2 cores, 12 minutes of CPU time); later runs print the cached paths at
# once.
#
# Prints, on stdout, shell lines that export IOP_LLAMA_SERVER and IOP_LLAMA_MODEL:
#     eval "$(scripts/real-backend.sh)"
# Progress goes to stderr. Needs python3 (with venv), a C++ compiler and the Python package
# index; cmake, ninja and the `gguf` package are installed into a private venv in the cache.
#
# Environment: IOP_REAL_BACKEND_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/iop).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION=0.3.36
CMAKE_VERSION=4.4.5
NINJA_VERSION=1.13.2
GGUF_VERSION=0.19.0
NUMPY_VERSION=2.4.6

CACHE="${IOP_REAL_BACKEND_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/iop}"
TOOLS="$CACHE/tools-venv"
BIN="$CACHE/llama-server-$LLAMA_CPP_PYTHON_VERSION/llama-server"
# The model file is named after the generator's content: a changed generator makes a new one.
GENERATOR="$PWD/scripts/tiny_gguf.py"
MODEL="$CACHE/models/tiny-llama-$(sha256sum "$GENERATOR" | cut -c1-12).gguf"

say() { echo "real-backend: $*" >&2; }

mkdir -p "$CACHE"
# One build at a time: concurrent runs wait here and then find the cached result.
exec 9>"$CACHE/.real-backend.lock"
flock 9

tools_venv() {
    local stamp="$TOOLS/.pins-$CMAKE_VERSION-$NINJA_VERSION-$GGUF_VERSION-$NUMPY_VERSION"
    [ -f "$stamp" ] && return
    say "installing cmake $CMAKE_VERSION, ninja $NINJA_VERSION and gguf $GGUF_VERSION into $TOOLS"
    rm -rf "$TOOLS"
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install --quiet --disable-pip-version-check \
        "cmake==$CMAKE_VERSION" "ninja==$NINJA_VERSION" \
        "gguf==$GGUF_VERSION" "numpy==$NUMPY_VERSION"
    touch "$stamp"
}

build_server() {
    [ -x "$BIN" ] && return
    tools_venv
    local work started
    work="$(mktemp -d)"
    # shellcheck disable=SC2064 # expand now: $work is local
    trap "rm -rf '$work'" EXIT
    started=$SECONDS
    say "fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION source distribution"
    # Only this package from source: its build requirements (fetched to read its metadata)
    # may come as wheels.
    "$TOOLS/bin/pip" download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    tar -xzf "$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$work"
    local src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
    [ -f "$src/tools/server/server.cpp" ] || { say "no llama.cpp server sources in the sdist"; exit 1; }
    say "building llama-server (10-20 minutes on 2 cores; cached afterwards)"
    # Offline-friendly: no web UI download, no TLS, no tests or examples. llama.cpp's own
    # libraries are linked in (no shared libraries of its own to find at run time), built for
    # any x86-64-v3 (AVX2) CPU, not just this one.
    "$TOOLS/bin/cmake" -S "$src" -B "$work/build" -G Ninja \
        -DCMAKE_MAKE_PROGRAM="$TOOLS/bin/ninja" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DGGML_NATIVE=OFF >"$work/configure.log" 2>&1 \
        || { cat "$work/configure.log" >&2; exit 1; }
    "$TOOLS/bin/cmake" --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
        || { tail -n 60 "$work/build.log" >&2; exit 1; }
    mkdir -p "$(dirname "$BIN")"
    install -m 0755 "$work/build/bin/llama-server" "$BIN.tmp"
    mv "$BIN.tmp" "$BIN"
    say "built $BIN in $((SECONDS - started)) s"
    rm -rf "$work"
    trap - EXIT
}

make_model() {
    [ -f "$MODEL" ] && return
    tools_venv
    say "generating the random-weight model $MODEL"
    mkdir -p "$(dirname "$MODEL")"
    "$TOOLS/bin/python" "$GENERATOR" "$MODEL.tmp" >&2
    mv "$MODEL.tmp" "$MODEL"
}

build_server
make_model
"$BIN" --version >/dev/null 2>&1 || { say "$BIN does not run"; exit 1; }
printf 'export IOP_LLAMA_SERVER=%q\n' "$BIN"
printf 'export IOP_LLAMA_MODEL=%q\n' "$MODEL"
