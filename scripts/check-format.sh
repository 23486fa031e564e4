#!/usr/bin/env bash
# `cargo fmt --check`, and proof that it saw every Rust file: rustfmt only follows `mod`
# items it can parse, so a module declared inside a macro would escape it silently. Every
# tracked `.rs` file must be one that `cargo fmt` formatted (the fuzz crate, outside the
# workspace, is checked by rustfmt directly).
set -euo pipefail
cd "$(dirname "$0")/.."
seen=$(mktemp)
trap 'rm -f "$seen"' EXIT
cargo fmt --all -- --check --verbose | sed -n 's|^Formatting '"$PWD"'/||p' | sort -u >"$seen"
missed=$(git ls-files '*.rs' | grep -v '^fuzz/' | sort | comm -23 - "$seen")
if [ -n "$missed" ]; then
  echo "cargo fmt does not reach these files (declared in a macro, or not a module of any crate?):" >&2
  echo "$missed" >&2
  exit 1
fi
rustfmt --edition 2021 --check $(git ls-files 'fuzz/*.rs')
echo "format: $(wc -l <"$seen") files checked by cargo fmt, $(git ls-files 'fuzz/*.rs' | wc -l) fuzz targets by rustfmt"
