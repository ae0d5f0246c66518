#!/usr/bin/env bash
# linvis against the same architectures on torch 2.x from PyPI (timm's DeiT, and bench/peer_models.py for
# vit3_tiny, hvit3_tiny, t5_tiny, vil_tiny and, with --task denoise, dit_s2, dit3_s2 and dit5_s2), eager and
# torch.compile, in one run (see bench/compare_torch.py).
# Makes (once) a virtual environment with torch and timm - outside linvis's own dependencies - and runs
# the comparison with it. Extra arguments go to compare_torch.py, e.g.
#   bench/compare_torch.sh --res 224,512,1024,2048 --markdown docs/results/peer.md
# Environment: LINVIS_PEER_VENV (default ~/.cache/linvis/peer-venv), LINVIS_PEER_TORCH (default 2.15.0),
# LINVIS_PEER_TIMM (default 1.0.31). The PyPI torch wheel for Linux pulls the CUDA runtime wheels too
# (several GB); only the CPU is used.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${LINVIS_PEER_VENV:-$HOME/.cache/linvis/peer-venv}"
torch_version="${LINVIS_PEER_TORCH:-2.15.0}"
timm_version="${LINVIS_PEER_TIMM:-1.0.31}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, timm, safetensors, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version' or timm.__version__ != '$timm_version')" 2>/dev/null; then
  "$venv/bin/pip" install --quiet "torch==$torch_version" "timm==$timm_version" safetensors
fi
# --linvis BINARY among the arguments replaces the default build/linvis.
linvis=build/linvis
prev=""
for arg in "$@"; do
  [ "$prev" = "--linvis" ] && linvis="$arg"
  case "$arg" in --linvis=*) linvis="${arg#--linvis=}" ;; esac
  prev="$arg"
done
[ -x "$linvis" ] || { echo "$linvis not found: run ./setup.sh first (or pass --linvis BINARY)" >&2; exit 1; }
exec "$venv/bin/python" bench/compare_torch.py --linvis "$linvis" "$@"
