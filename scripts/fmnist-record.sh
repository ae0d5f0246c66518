#!/usr/bin/env bash
# Reproduces the Fashion-MNIST record of docs/training.md: the tiny linear models and the DeiT baseline,
# one recipe, trained two at a time side by side with one thread each (a 2-core machine runs one pair
# at full speed). Each run's wall time and final test top-1 are printed as a table at the end.
#
#   scripts/fmnist-record.sh [OUTPUT_DIR]        (default: runs/fmnist)
#
# A run takes 25-32 minutes; the five take about 90 minutes. Needs ./build/linvis (scripts/build.sh)
# and Debian's dataset-fashion-mnist (installed by ./setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/fmnist}"
mkdir -p "$out"
linvis=./build/linvis

# The recipe shared by every model: AdamW lr 2e-3 (cosine, half an epoch of warm-up), batch 64, label
# smoothing 0.1, weight decay 0.05; no mixup/cutmix, no drop path, no crop/flip. Short schedules on
# 60,000 28x28 images underfit, so regularisation that slows fitting costs accuracy here.
recipe=(--dataset fashion-mnist --batch-size 64 --lr 2e-3 --warmup-epochs 0.5 --mixup 0 --cutmix 0
        --drop-path 0 --no-augment --threads 1 --no-progress)

# name | model | model options | epochs (about what fits in 30 minutes on one Zen 4 core; docs/training.md
# has the times measured, vil and t5 took 31-32 minutes)
runs=(
  "vittt|vittt_tiny|embed_dim=96 depth=4 num_heads=2 impl=fused|7"
  "vil|vil_tiny|embed_dim=96 depth=3 impl=fused|7"
  "vit3|vit3_tiny|embed_dim=96 depth=4 num_heads=2 impl=fused|11"
  "t5|t5_tiny|embed_dim=96 depth=4 num_heads=2 impl=fused|12"
  "deit|deit_tiny|embed_dim=96 depth=4 num_heads=4|14"
)

train_one() {
  local name="$1" model="$2" kwargs="$3" epochs="$4"
  local start=$SECONDS
  # shellcheck disable=SC2086  # the model options are separate words on purpose
  "$linvis" train --model "$model" --model-kwargs $kwargs --epochs "$epochs" "${recipe[@]}" \
      --output "$out/$name" > "$out/$name.log" 2>&1
  echo "$((SECONDS - start))" > "$out/$name.seconds"
}

pending=()
for spec in "${runs[@]}"; do
  IFS='|' read -r name model kwargs epochs <<< "$spec"
  if [ -f "$out/$name.seconds" ]; then continue; fi  # finished in an earlier invocation
  train_one "$name" "$model" "$kwargs" "$epochs" &
  pending+=("$!")
  if [ "${#pending[@]}" -eq 2 ]; then wait "${pending[@]}"; pending=(); fi
done
if [ "${#pending[@]}" -gt 0 ]; then wait "${pending[@]}"; fi

printf '%-8s %-12s %7s %10s\n' run model epochs "wall min"
for spec in "${runs[@]}"; do
  IFS='|' read -r name model kwargs epochs <<< "$spec"
  result=$(grep -o 'test top-1 [0-9.]*%' "$out/$name.log" | tail -n 1 || true)
  printf '%-8s %-12s %7s %10.1f  %s\n' "$name" "$model" "$epochs" \
      "$(awk '{print $1 / 60}' "$out/$name.seconds")" "${result:-failed: see $out/$name.log}"
done
