#!/usr/bin/env bash
# Builds the libFuzzer target for the safetensors header parser with clang (ASan + UBSan) in
# ./build-fuzz and fuzzes it for SECONDS seconds, starting from a copy of the seed corpus.
#   scripts/fuzz.sh 300    fuzz for 5 minutes
#   scripts/fuzz.sh 0      only replay the seed corpus (a regression run)
# Exits non-zero on any finding; the crashing input is kept in build-fuzz/artifacts/ and can be
# replayed with: build-fuzz/fuzz_safetensors build-fuzz/artifacts/<file>
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
case "$seconds" in ''|*[!0-9]*) echo "fuzz.sh: SECONDS must be a whole number, got '$seconds'" >&2; exit 2;; esac
if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found (scripts/install-deps.sh installs clang and libclang-rt-14-dev)" >&2
  exit 1
fi
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build build-fuzz --target fuzz_safetensors

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" build-fuzz/artifacts
cp fuzz/corpus/safetensors/* "$work/corpus/"
args=(-max_len=4096 -timeout=10 -rss_limit_mb=2048 -dict=fuzz/safetensors.dict
      -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1)
if [ "$seconds" -eq 0 ]; then
  args+=(-runs=0)
else
  args+=(-max_total_time="$seconds")
fi
echo "fuzz.sh: fuzz_safetensors for ${seconds}s from $(ls "$work/corpus" | wc -l) seed files"
if ! ./build-fuzz/fuzz_safetensors "${args[@]}" "$work/corpus" >"$work/log" 2>&1; then
  tail -n 60 "$work/log" >&2
  echo "fuzz.sh: FINDING: fuzz_safetensors failed; input saved under build-fuzz/artifacts/" >&2
  exit 1
fi
grep -E "^stat::number_of_executed_units|^stat::peak_rss_mb|INFO: Running with|Done [0-9]+ runs" "$work/log" || true
echo "fuzz.sh: no findings"
