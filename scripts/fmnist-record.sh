#!/usr/bin/env bash
# Reproduces the Fashion-MNIST record of docs/training.md: the tiny linear models and the DeiT baseline
# trained one after another, each alone on the machine with two threads (--threads 2). Each run's wall
# time and final test top-1 are printed as a table at the end.
#
#   scripts/fmnist-record.sh [OUTPUT_DIR]        (default: runs/fmnist)
#
# A run takes 20-30 minutes; the six runs about two and a half hours. Needs ./build/linvis
# (scripts/build.sh) and Debian's dataset-fashion-mnist (installed by ./setup.sh). A run that finished
# in an earlier invocation is not repeated.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/fmnist}"
mkdir -p "$out"
linvis=./build/linvis

# The recipe shared by every model: AdamW lr 2e-3 (cosine, half an epoch of warm-up), batch 64, label
# smoothing 0.1, weight decay 0.05; no mixup/cutmix, no drop path. Short schedules on 60,000 28x28
# images underfit, so regularisation that slows fitting costs accuracy here. vil and t5, which plateaued
# just under 91 % without it, use horizontal flips only (--augment flip); deit runs both ways.
recipe=(--dataset fashion-mnist --batch-size 64 --lr 2e-3 --warmup-epochs 0.5 --mixup 0 --cutmix 0
        --drop-path 0 --threads 2 --no-progress)

# name | model | model options | epochs | further options
runs=(
  "vittt|vittt_tiny|embed_dim=96 depth=4 num_heads=2 impl=fused|7|--augment none"
  "vil|vil_tiny|embed_dim=96 depth=3 impl=fused|8|--augment flip --eval-every 4"
  "vit3|vit3_tiny|embed_dim=96 depth=4 num_heads=2 impl=fused|11|--augment none"
  "t5|t5_tiny|embed_dim=96 depth=4 num_heads=4 impl=fused|15|--augment flip --eval-every 3"
  "deit|deit_tiny|embed_dim=96 depth=4 num_heads=4|17|--augment flip --eval-every 3"
  "deit_plain|deit_tiny|embed_dim=96 depth=4 num_heads=4|14|--augment none"
)

for spec in "${runs[@]}"; do
  IFS='|' read -r name model kwargs epochs extra <<< "$spec"
  if [ -f "$out/$name.seconds" ]; then continue; fi
  start=$SECONDS
  # shellcheck disable=SC2086  # the model options and further options are separate words on purpose
  "$linvis" train --model "$model" --model-kwargs $kwargs --epochs "$epochs" "${recipe[@]}" $extra \
      --output "$out/$name" > "$out/$name.log" 2>&1
  echo "$((SECONDS - start))" > "$out/$name.seconds"
done

printf '%-8s %-12s %7s %10s\n' run model epochs "wall min"
for spec in "${runs[@]}"; do
  IFS='|' read -r name model kwargs epochs extra <<< "$spec"
  result=$(grep -o 'test top-1 [0-9.]*%' "$out/$name.log" | tail -n 1 || true)
  printf '%-8s %-12s %7s %10.1f  %s\n' "$name" "$model" "$epochs" \
      "$(awk '{print $1 / 60}' "$out/$name.seconds")" "${result:-failed: see $out/$name.log}"
done
