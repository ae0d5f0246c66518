#!/usr/bin/env bash
# Configures (once) and builds linvis into ./build. Extra arguments go to cmake's configure step.
# LINVIS_TARGETS (space-separated) builds only those targets, e.g. "linvis_cli" for the library and
# the command without the tests and benchmarks (what ./setup.sh needs).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${LINVIS_JOBS:-$(nproc)}"
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
fi
targets=()
for t in ${LINVIS_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build build -j "$jobs" "${targets[@]}"
