# Sourced by the bench scripts that load the service (`wasi-nn-host serve`) with loadgen.
#
#   bench_binaries DIR
#       Sets host, component and loadgen from DIR (wasi-nn-host, gpt2_component.wasm,
#       loadgen), or with `local` from this checkout's release builds (target/), the component
#       pre-initialised (made with `wasi-nn-host preinit` when missing or older than the
#       component; otherwise every request would build its tokenizer).
#   bench_serve PORT SERVE_ARGS...
#       Starts `$host serve --component $component --port PORT SERVE_ARGS...` (its log in
#       /tmp/server-PORT.log), sets server to its pid and url to its address, and waits until
#       it answers; if it does not come up, prints its log's end and returns 1.

bench_binaries() {
  local dir=$1 root plain
  if [ "$dir" = local ]; then
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    host=$root/target/release/wasi-nn-host loadgen=$root/target/release/loadgen
    plain=$root/target/wasm32-wasip2/release-wasm/gpt2_component.wasm
    component=${plain%.wasm}.preinit.wasm
    # made again when older than the component, or from before snapshots carried their marker
    if [ ! -f "$component" ] || [ "$plain" -nt "$component" ] ||
      ! tail -c 64 "$component" | grep -q 'wasi-nn-host:preinitialised'; then
      "$host" preinit "$plain" "$component" || return 1
    fi
  else
    host=$dir/wasi-nn-host component=$dir/gpt2_component.wasm loadgen=$dir/loadgen
  fi
}

bench_serve() {
  local port=$1
  shift
  "$host" serve --component "$component" --port "$port" "$@" 2>"/tmp/server-$port.log" &
  server=$!
  url=http://127.0.0.1:$port
  for _ in $(seq 300); do
    curl -sf "$url/health" >/dev/null && return 0
    kill -0 "$server" 2>/dev/null || break
    sleep 0.2
  done
  curl -sf "$url/health" >/dev/null && return 0
  echo "the service did not come up; its log:" >&2
  tail -20 "/tmp/server-$port.log" >&2
  return 1
}
