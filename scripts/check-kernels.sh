#!/usr/bin/env bash
# Compiles every CUDA kernel with NVRTC, no GPU needed: NVRTC comes from NVIDIA's wheel on
# PyPI (cached under target/nvrtc). Skips, saying why, when the wheel cannot be fetched.
# Then assembles the sm_90 PTX with CUDA 13's ptxas (the compiler of the GPU machines' driver
# and NVRTC; from the nvcc wheel, cached beside it) and fails on a kernel that spills
# registers beyond its allowance (`scripts/kernel-spills.py`).
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

# (allowed: the opt-in persistent kernel's f32 build)
ptxas_wheel=nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
ptxas=$dir/cu13/nvidia/cu13/bin/ptxas
if [ ! -x "$ptxas" ]; then
  if ! python3 -m pip download --quiet --no-deps --only-binary=:all: nvidia-cuda-nvcc==13.0.88 -d "$dir" \
      || ! python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('nvidia/cu13/bin/ptxas', sys.argv[2])" \
        "$dir/$ptxas_wheel" "$dir/cu13"; then
    echo "check-kernels: spill check SKIPPED, could not fetch CUDA 13's ptxas from PyPI"
    exit 0
  fi
  chmod +x "$ptxas"
  rm -f "$dir/$ptxas_wheel"
fi
target/release/wasi-nn-host compile-kernels --arch compute_90 --out "$dir/kernels-compute_90.ptx"
"$ptxas" -arch=sm_90 -v "$dir/kernels-compute_90.ptx" -o /dev/null 2>&1 \
  | python3 scripts/kernel-spills.py --allow persistent_decode_f32=116
