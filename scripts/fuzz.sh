#!/usr/bin/env bash
# Builds the libFuzzer targets (one per reader of untrusted bytes) with clang (ASan + UBSan) in
# ./build-fuzz and fuzzes each from a copy of its seed corpus fuzz/corpus/<name>/:
#   fuzz_safetensors    safetensors header parser (no LibTorch)
#   fuzz_pth            torch.save reader: zip container, legacy format, pickle + allow-list
#   fuzz_image          PNG / JPEG / BMP decoding path
#   fuzz_idx            IDX reader (gzip or plain)
#   fuzz_cifar          CIFAR-10/100 binary reader
#   fuzz_image_folder   image-folder scanner (a directory tree built from the input)
# Usage:
#   scripts/fuzz.sh 60                 60 seconds in total, split evenly over the targets (./test.sh)
#   scripts/fuzz.sh 0                  only replay every seed corpus (a regression run)
#   scripts/fuzz.sh 300 pth image      5 minutes split over the named targets
#   LINVIS_FUZZ_RUNS=1000000 scripts/fuzz.sh 0 pth    exactly one million executions instead of a time budget
# Exits non-zero on any finding; the crashing input is kept in build-fuzz/artifacts/ and can be
# replayed with: build-fuzz/fuzz_<name> build-fuzz/artifacts/<file>
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
case "$seconds" in ''|*[!0-9]*) echo "fuzz.sh: SECONDS must be a whole number, got '$seconds'" >&2; exit 2;; esac
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors pth image idx cifar image_folder)
runs="${LINVIS_FUZZ_RUNS:-}"
if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: clang++ not found (scripts/install-deps.sh installs clang and libclang-rt-14-dev)" >&2
  exit 1
fi
if [ ! -f build-fuzz/CMakeCache.txt ]; then
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "${launcher[@]}" >/dev/null
fi
build_targets=()
for t in "${targets[@]}"; do build_targets+=(--target "fuzz_$t"); done
cmake --build build-fuzz -j "${LINVIS_JOBS:-$(nproc)}" "${build_targets[@]}"

per_target=$(( seconds / ${#targets[@]} ))
[ "$seconds" -gt 0 ] && [ "$per_target" -lt 1 ] && per_target=1
status=0
for t in "${targets[@]}"; do
  # The path-taking readers get their input through scratch files: keep them in memory when possible.
  if [ -d /dev/shm ] && [ -w /dev/shm ]; then work="$(mktemp -d -p /dev/shm)"; else work="$(mktemp -d)"; fi
  mkdir -p "$work/corpus" build-fuzz/artifacts
  cp fuzz/corpus/"$t"/* "$work/corpus/"
  # Inputs beyond max_len are cut: big enough for every seed of the target.
  case "$t" in
    safetensors) max_len=4096 ;;
    pth) max_len=8192 ;;
    cifar) max_len=16384 ;;
    *) max_len=4096 ;;
  esac
  args=(-max_len="$max_len" -timeout=10 -rss_limit_mb=2560 -artifact_prefix=build-fuzz/artifacts/ -print_final_stats=1)
  [ -f "fuzz/$t.dict" ] && args+=(-dict="fuzz/$t.dict")
  if [ -n "$runs" ]; then
    args+=(-runs="$runs")
    what="$runs runs"
  elif [ "$seconds" -eq 0 ]; then
    args+=(-runs=0)
    what="seed replay"
  else
    args+=(-max_total_time="$per_target")
    what="${per_target}s"
  fi
  echo "fuzz.sh: fuzz_$t for $what from $(ls "$work/corpus" | wc -l) seed files"
  # LibTorch's own one-time allocations are not leaks of the readers: leak checking is off for
  # the targets linked against it; ASan and UBSan stay on.
  leaks=1
  [ "$t" != safetensors ] && leaks=0
  if ! ASAN_OPTIONS="detect_leaks=$leaks:${ASAN_OPTIONS:-}" TMPDIR="$work" \
       ./build-fuzz/fuzz_"$t" "${args[@]}" "$work/corpus" >"$work/log" 2>&1; then
    tail -n 60 "$work/log" >&2
    echo "fuzz.sh: FINDING: fuzz_$t failed; input saved under build-fuzz/artifacts/" >&2
    status=1
  else
    grep -E "^stat::number_of_executed_units|^stat::average_exec_per_sec|^stat::peak_rss_mb|Done [0-9]+ runs" "$work/log" || true
  fi
  rm -rf "$work"
done
[ "$status" -eq 0 ] && echo "fuzz.sh: no findings"
exit "$status"
