#!/usr/bin/env bash
# Builds linvis (incrementally) and runs the test suite.
#   ./test.sh        unit tests and a short bounded fuzz run (what CI runs)
#   ./test.sh --all  also the tests labelled 'slow'
set -euo pipefail
cd "$(dirname "$0")"
./scripts/build.sh
label_args=(-L unit)
[ "${1:-}" = "--all" ] && label_args=()
ctest --test-dir build "${label_args[@]}" --output-on-failure -j "$(nproc)" --timeout 900
if [ -x scripts/fuzz.sh ]; then
  scripts/fuzz.sh "${LINVIS_FUZZ_SECONDS:-60}"
fi
