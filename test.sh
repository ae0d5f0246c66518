#!/usr/bin/env bash
# Builds linvis (incrementally) and runs the test suite.
#   ./test.sh        unit tests and a short bounded fuzz run of every file reader (what CI runs)
# LINVIS_FUZZ_SECONDS sets the fuzz run's total length, split evenly over the six libFuzzer targets
# (default 60, i.e. 10 s each; 0 replays the seed corpora only).
set -euo pipefail
cd "$(dirname "$0")"
./scripts/build.sh
label_args=(-L unit)
set +e
ctest --test-dir build "${label_args[@]}" --output-on-failure -j "$(nproc)" --timeout 900 | tee build/ctest.log
ctest_status=${PIPESTATUS[0]}
set -e
fuzz_status=0
if [ -x scripts/fuzz.sh ]; then
  scripts/fuzz.sh "${LINVIS_FUZZ_SECONDS:-60}" || fuzz_status=$?
fi
# One closing line for the whole run: unit tests plus the fuzz run as one more check.
summary=$(grep -Eo '[0-9]+ tests failed out of [0-9]+' build/ctest.log | tail -n 1 || true)
if [ -z "$summary" ]; then
  echo "tests: 0 passed, 1 failed (ctest ran no test)"
  exit 1
fi
failed=$(echo "$summary" | awk '{print $1}')
total=$(echo "$summary" | awk '{print $6}')
failed=${failed:-0}; total=${total:-0}
[ "$fuzz_status" -ne 0 ] && failed=$((failed + 1))
total=$((total + 1))
echo "tests: $((total - failed)) passed, ${failed} failed"
[ "$ctest_status" -eq 0 ] && [ "$fuzz_status" -eq 0 ]
