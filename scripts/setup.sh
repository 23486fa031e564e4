#!/usr/bin/env bash
# Installs the pinned toolchain with the wasm targets (rust-toolchain.toml) on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup toolchain install >/dev/null 2>&1 || rustup toolchain install
rustup target list --installed | grep -q wasm32-wasip1 || rustup target add wasm32-wasip1
rustup target list --installed | grep -q wasm32-wasip2 || rustup target add wasm32-wasip2
