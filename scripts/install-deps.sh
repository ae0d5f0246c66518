#!/usr/bin/env bash
# Installs every system package linvis needs to build, test and run (Debian 12).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libtorch-dev libopenblas-dev libopenblas0-pthread   # LibTorch 1.13 and the BLAS it should call
  libgloo-dev                                         # headers of the Gloo transport behind c10d (linvis train --nproc-per-node)
  nlohmann-json3-dev libstb-dev                         # JSON headers; PNG/BMP decoding, image writing
  libjpeg62-turbo-dev                                   # libjpeg-turbo: JPEG decoding (Pillow's pixels)
  libcli11-dev                                          # command-line parsing of the linvis program
  libdnnl-dev                                           # oneDNN: the float32 GEMM of the linear layers
  libhwy-dev                                            # Google Highway: the fused kernels' SIMD layer (src/ops/simd)
  libtcmalloc-minimal4                                  # gperftools' tcmalloc: the linvis command's malloc (core/runtime.h)
  zlib1g-dev                                            # gzip IDX files (Fashion-MNIST), PNG CRCs
  fonts-dejavu-core                                     # DejaVu Sans for text in plots (linvis/plot/plot.h)
  libgtest-dev libgmock-dev                             # unit tests
  clang libclang-rt-14-dev                              # libFuzzer target for the safetensors reader
  dataset-fashion-mnist                                 # training data used by 'linvis train'
  qemu-user                                             # emulated AVX2-only CPU for ISA-sensitive tests
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# LibTorch links libblas.so.3; make sure OpenBLAS, not the reference BLAS, answers.
if [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO update-alternatives --set libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null
  $SUDO update-alternatives --set liblapack.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-pthread/liblapack.so.3 >/dev/null
fi
echo "dependencies installed"
