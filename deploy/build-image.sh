#!/usr/bin/env bash
# Builds the container image of `wasi-nn-host serve` (deploy/Containerfile) from Debian's
# packages and this repository's own build, with no image registry:
#
#   deploy/build-image.sh [--with-cublas] [TAG]     TAG: $WASI_NN_IMAGE, else wasi-nn-host:latest
#
# 1. The base image wasi-nn-base:bookworm: `debootstrap --variant=minbase bookworm` from the
#    mirror this machine's apt uses ($WASI_NN_DEBIAN_MIRROR overrides it) into
#    target/image/rootfs (kept for the next build), trimmed like Debian's slim images (no
#    docs, man pages, locales or apt lists), imported with `docker import`. Skipped while
#    that image exists.
# 2. The CLI (cargo build --release), the guest component (wasm32-wasip2, pre-initialised
#    as scripts/test-python.sh does), NVRTC 12.9 from NVIDIA's wheel on PyPI (target/nvrtc,
#    shared with scripts/check-kernels.sh) and, with --with-cublas, cuBLAS and cuBLASLt 12.9
#    from theirs (target/cublas; a 580 MB wheel, 850 MB more in the image), staged with the default
#    model in target/image/context: the build context holds exactly what the image gets.
# 3. docker build -f deploy/Containerfile target/image/context (the classic builder: Debian's
#    docker.io has no buildx).
#
# Needs root for debootstrap and docker (uses sudo otherwise), and Debian's debootstrap and
# docker.io (scripts/test-image.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_VERSION=12.9.86
CUBLAS_VERSION=12.9.1.4
BASE_IMAGE=wasi-nn-base:bookworm

tag=${WASI_NN_IMAGE:-wasi-nn-host:latest}
cublas=0
while [ $# -gt 0 ]; do
  case "$1" in
    --with-cublas) cublas=1 ;;
    --tag) tag=$2; shift ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "build-image: unknown option $1" >&2; exit 2 ;;
    *) tag=$1 ;;
  esac
  shift
done

sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
docker=(docker)
docker info >/dev/null 2>&1 || docker=($sudo docker)
if ! "${docker[@]}" info >/dev/null 2>&1; then
  echo "build-image: no docker engine answers (start dockerd, or run scripts/test-image.sh)" >&2
  exit 1
fi
say() { echo "build-image: $*"; }

# The Debian mirror of this machine's apt: the first deb source for bookworm (one-line
# sources.list or deb822 .sources files), else deb.debian.org.
debian_mirror() {
  local f uri=""
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    uri=$(awk '$1 == "deb" { n = 2; if ($n ~ /^\[/) { while (n < NF && $n !~ /\]$/) n++; n++ }
                             if ($(n + 1) == "bookworm") { print $n; exit } }' "$f")
    [ -n "$uri" ] && break
  done
  if [ -z "$uri" ]; then
    for f in /etc/apt/sources.list.d/*.sources; do
      [ -r "$f" ] || continue
      uri=$(awk 'BEGIN { RS = ""; FS = "\n" }
        { t = u = s = ""; off = 0
          for (j = 1; j <= NF; j++) {
            if ($j ~ /^Types:/) t = $j; if ($j ~ /^URIs:/) u = $j; if ($j ~ /^Suites:/) s = $j
            if ($j ~ /^Enabled:[ \t]*no/) off = 1 }
          if (!off && t ~ /[ \t]deb([ \t]|$)/ && s ~ /[ \t]bookworm([ \t]|$)/) {
            split(u, w, /[ \t]+/); print w[2]; exit } }' "$f")
      [ -n "$uri" ] && break
    done
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

# 1. The base image.
image=target/image
if ! "${docker[@]}" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  rootfs=$image/rootfs
  if [ ! -e "$image/rootfs.done" ]; then
    mirror=${WASI_NN_DEBIAN_MIRROR:-$(debian_mirror)}
    say "debootstrap --variant=minbase bookworm from $mirror into $rootfs"
    $sudo rm -rf "$rootfs"
    mkdir -p "$image"
    $sudo debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$image/debootstrap.log" 2>&1 || {
      tail -20 "$image/debootstrap.log" >&2
      exit 1
    }
    touch "$image/rootfs.done"
  fi
  # Trimmed as Debian's -slim images are: no documentation (the copyright files stay), man
  # pages, translations, package lists or downloaded packages; nothing of the build machine's.
  $sudo find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  $sudo find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  $sudo find "$rootfs/var/log" -type f -delete
  $sudo rm -rf "$rootfs"/usr/share/{man,info,locale,lintian}/* "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/cache/debconf/*-old "$rootfs"/etc/hostname "$rootfs"/etc/resolv.conf
  say "importing $rootfs as $BASE_IMAGE"
  # /dev, /proc and /sys are the container runtime's to fill.
  $sudo tar -C "$rootfs" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' \
    --exclude='./sys/*' -cf - . |
    "${docker[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
fi

# 2. What goes into the image.
scripts/setup.sh
cargo build --quiet --release -p wasi-nn-host
cargo build --quiet -p gpt2-component --lib --target wasm32-wasip2 --profile release-wasm
wasm=target/wasm32-wasip2/release-wasm
# made again when older than the component, or from before snapshots carried their marker
if [ ! "$wasm/gpt2_component.preinit.wasm" -nt "$wasm/gpt2_component.wasm" ] ||
  ! tail -c 64 "$wasm/gpt2_component.preinit.wasm" | grep -q 'wasi-nn-host:preinitialised'; then
  target/release/wasi-nn-host preinit "$wasm/gpt2_component.wasm" "$wasm/gpt2_component.preinit.wasm"
fi

# A wheel of NVIDIA's from PyPI (`name==version`) unpacked under `dir`/x, unless it is there.
wheel() {
  local spec=$1 dir=$2
  [ -e "$dir/x.done" ] && return
  python3 -m pip --version >/dev/null 2>&1 || {
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-pip >/dev/null
  }
  mkdir -p "$dir"
  say "fetching $spec from PyPI"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    "$spec" -d "$dir"
  rm -rf "$dir/x"
  python3 -m zipfile -e "$dir"/"$(echo "${spec%%==*}" | tr - _)"-*.whl "$dir/x"
  rm -f "$dir"/*.whl
  touch "$dir/x.done"
}
nvrtc=target/nvrtc
if ! ls "$nvrtc"/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.* >/dev/null 2>&1; then
  rm -f "$nvrtc/x.done"
  wheel nvidia-cuda-nvrtc-cu12==$NVRTC_VERSION "$nvrtc"
fi
if [ "$cublas" = 1 ]; then
  wheel nvidia-cublas-cu12==$CUBLAS_VERSION target/cublas
fi

context=$image/context
rm -rf "$context"
mkdir -p "$context/bin" "$context/lib" "$context/models"
cp target/release/wasi-nn-host "$context/bin/"
cp "$wasm/gpt2_component.preinit.wasm" "$context/gpt2_component.wasm"
cp -r models/gpt2-shakespeare "$context/models/"
cp -P "$nvrtc"/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12* "$nvrtc"/x/nvidia/cuda_nvrtc/lib/libnvrtc-builtins.so* \
  "$context/lib/"
if [ "$cublas" = 1 ]; then
  cp -P target/cublas/x/nvidia/cublas/lib/libcublas.so.12* target/cublas/x/nvidia/cublas/lib/libcublasLt.so.12* \
    "$context/lib/"
fi
if [ "$cublas" = 1 ]; then
  # the kernels compiled ahead for the GPUs of these architectures (A100, A10, L4, H100/H200):
  # a first start on one of them loads them (2-3 s) instead of compiling (about 20 s)
  for arch in sm_80 sm_86 sm_89 sm_90; do
    LD_LIBRARY_PATH="$PWD/$nvrtc/x/nvidia/cuda_nvrtc/lib" target/release/wasi-nn-host compile-kernels \
      --arch "$arch" --into "$context/kernels" >/dev/null
  done
  say "kernels compiled ahead: $(ls "$context/kernels" | tr '\n' ' ')"
fi
chmod -R a+rX,go-w "$context"

# 3. The image.
if [ "$cublas" = 1 ]; then
  say "building $tag with cuBLAS"
else
  say "building $tag without cuBLAS: for the CPU; --device cuda needs --with-cublas (see deploy/Containerfile)"
fi
revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if ! DOCKER_BUILDKIT=0 "${docker[@]}" build --force-rm -f deploy/Containerfile \
  --label "org.opencontainers.image.revision=$revision" --label "wasi-nn.cublas=$cublas" \
  -t "$tag" "$context" >"$image/build.log" 2>&1; then
  tail -30 "$image/build.log" >&2
  exit 1
fi
bytes=$("${docker[@]}" image inspect -f '{{.Size}}' "$tag")
say "$tag: $((bytes / 1000000)) MB"
