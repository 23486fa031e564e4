#!/usr/bin/env bash
# Compiles every CUDA kernel with NVRTC, no GPU needed: NVRTC comes from NVIDIA's wheel on
# PyPI (cached under target/nvrtc). Skips, saying why, when the wheel cannot be fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/nvrtc
if ! ls "$dir"/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.* >/dev/null 2>&1; then
  mkdir -p "$dir"
  if ! python3 -m pip download --quiet --no-deps --only-binary=:all: nvidia-cuda-nvrtc-cu12==12.9.86 -d "$dir" \
      || ! python3 -m zipfile -e "$dir"/nvidia_cuda_nvrtc_cu12-*.whl "$dir"/x; then
    echo "check-kernels: SKIPPED, could not fetch NVRTC from PyPI"
    exit 0
  fi
fi
cargo build --quiet --release -p wasi-nn-host
export LD_LIBRARY_PATH="$PWD/$dir/x/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for arch in compute_80 compute_90 sm_90; do
  target/release/wasi-nn-host compile-kernels --arch "$arch"
done
