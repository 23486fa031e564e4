#!/usr/bin/env bash
# The container image as it ships (deploy/Containerfile, built by deploy/build-image.sh), on the
# CPU: it serves what the plain binary serves. Installs Debian's docker.io and debootstrap
# with apt-get where missing and starts dockerd where no engine answers (and stops it at the
# end); then builds the image and runs it with host networking beside the plain binary:
# - GET /health says ok, on the CPU;
# - the same completions (greedy, and sampled with a seed) give the same non-empty texts from
#   the container and from target/release/wasi-nn-host;
# - the service runs as uid 10001, not root;
# - the bundled NVRTC compiles the kernels inside the image (no GPU needed), and without a
#   driver `--device cuda` stops with the clear error;
# - `docker stop` (SIGTERM) lets a request in flight finish and the service exit 0 in time.
# Needs root (sudo otherwise), Debian's mirror and PyPI (NVRTC's wheel). The first run
# debootstraps the base (kept under target/image); later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
tag=${WASI_NN_IMAGE:-wasi-nn-host:latest}
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
say() { echo "test-image: $*"; }
fail() {
  echo "test-image: FAILED: $*" >&2
  exit 1
}

missing=()
# docker.io: the client, and the engine where none answers
if ! command -v docker >/dev/null || { ! command -v dockerd >/dev/null && ! $sudo docker info >/dev/null 2>&1; }; then
  missing+=(docker.io)
fi
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} with apt-get"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

docker=(docker)
docker info >/dev/null 2>&1 || docker=($sudo docker)
dockerd_pid=""
container=wasi-nn-test-$$
plain_pid=""
cleanup() {
  set +e
  "${docker[@]}" rm -f "$container" "$container-gpu" >/dev/null 2>&1
  [ -n "$plain_pid" ] && kill "$plain_pid" 2>/dev/null && wait "$plain_pid" 2>/dev/null
  if [ -n "$dockerd_pid" ]; then
    $sudo kill "$dockerd_pid" 2>/dev/null
    for _ in $(seq 60); do $sudo kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
  fi
}
trap cleanup EXIT
if ! "${docker[@]}" info >/dev/null 2>&1; then
  mkdir -p target/image
  say "starting dockerd (log: target/image/dockerd.log)"
  docker=($sudo docker)
  $sudo dockerd >target/image/dockerd.log 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 120); do
    "${docker[@]}" info >/dev/null 2>&1 && break
    $sudo kill -0 "$dockerd_pid" 2>/dev/null || { tail -20 target/image/dockerd.log >&2; fail "dockerd exited"; }
    sleep 0.5
  done
  "${docker[@]}" info >/dev/null 2>&1 || fail "dockerd did not answer in 60 s"
fi

deploy/build-image.sh "$tag"
built=$(date +%s)

wasm=target/wasm32-wasip2/release-wasm/gpt2_component.preinit.wasm
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
plain_port=$(free_port)
[ "$port" != "$plain_port" ] || plain_port=$(free_port)

# The image's flags are appended to its entry point: --port only (the address, 0.0.0.0, comes
# from WASI_NN_SERVE_HOST in the image).
"${docker[@]}" run -d --name "$container" --network host "$tag" --port "$port" >/dev/null
target/release/wasi-nn-host serve --component "$wasm" --port "$plain_port" >target/image/plain.log 2>&1 &
plain_pid=$!

# HTTP checks, in Python's standard library: `http METHOD PORT PATH [JSON]` prints the body.
http() {
  python3 - "$@" <<'EOF'
import sys, urllib.request
method, port, path = sys.argv[1:4]
data = sys.argv[4].encode() if len(sys.argv) > 4 else None
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                             headers={"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    sys.stdout.write(r.read().decode())
EOF
}
field() { python3 -c "import json, sys; d = json.load(sys.stdin); print($1)"; }
wait_health() {
  local port=$1 what=$2
  for _ in $(seq 240); do
    http GET "$port" /health 2>/dev/null && return 0
    sleep 0.25
  done
  fail "$what did not answer /health in 60 s"
}

health=$(wait_health "$port" container) ||
  { "${docker[@]}" logs "$container" 2>&1 | tail -20 >&2; exit 1; }
wait_health "$plain_port" "the plain binary" >/dev/null || { tail -20 target/image/plain.log >&2; exit 1; }
[ "$(field 'd["status"] + " " + d["device"]' <<<"$health")" = "ok cpu" ] || fail "/health said $health"
say "/health: $health"

"${docker[@]}" logs "$container" 2>&1 | grep -q "listening on http://0.0.0.0:$port" ||
  fail "the image does not listen on 0.0.0.0 by WASI_NN_SERVE_HOST: $("${docker[@]}" logs "$container" 2>&1 | tail -3)"

texts=0
for body in '{"prompt":"ROMEO:","max_tokens":24,"temperature":0}' \
  '{"prompt":"ROMEO:","max_tokens":24,"temperature":0.8,"top_p":0.95,"seed":7}'; do
  ours=$(http POST "$port" /v1/completions "$body" | field 'd["choices"][0]["text"]')
  plain=$(http POST "$plain_port" /v1/completions "$body" | field 'd["choices"][0]["text"]')
  [ -n "$ours" ] || fail "empty text from the container for $body"
  [ "$ours" = "$plain" ] || fail "the container and the binary differ for $body: $ours <> $plain"
  texts=$((texts + 1))
done
say "$texts completions equal to the plain binary's"

pid=$("${docker[@]}" inspect -f '{{.State.Pid}}' "$container")
uid=$($sudo awk '/^Uid:/ { print $2 }' "/proc/$pid/status")
[ "$uid" = 10001 ] || fail "the service runs as uid $uid, not 10001"

# NVRTC of the image compiles the kernels (no GPU needed); no driver: the clear error.
nvrtc=$("${docker[@]}" run --rm --entrypoint /opt/wasi-nn/bin/wasi-nn-host "$tag" compile-kernels --arch compute_90) ||
  fail "compile-kernels in the image: $nvrtc"
# and machine code for an architecture, into a folder (as the GPU image's kernels/ is made)
cubin=$("${docker[@]}" run --rm --entrypoint sh "$tag" -c \
  'wasi-nn-host compile-kernels --arch sm_90 --into /tmp/k && ls /tmp/k') ||
  fail "compile-kernels --arch sm_90 in the image: $cubin"
grep -q 'bytes of CUBIN' <<<"$cubin" && grep -q -- '-sm_90\.cubin$' <<<"$cubin" ||
  fail "compile-kernels --arch sm_90 made no CUBIN: $cubin"
if out=$("${docker[@]}" run --rm --name "$container-gpu" -e NVIDIA_VISIBLE_DEVICES=void "$tag" \
  --device cuda --port "$(free_port)" 2>&1); then
  fail "--device cuda started without a driver"
fi
grep -q "no CUDA driver (libcuda.so) found" <<<"$out" || fail "--device cuda without a driver said: $out"
say "in the image: $nvrtc; --device cuda without a driver: 'no CUDA driver (libcuda.so) found'"

# SIGTERM: a stream in flight finishes, then the service exits 0, within the grace. The stream
# starts, `docker stop` is sent once its first tokens came, and the rest must follow to [DONE].
grace=40
drained=$(python3 - "$port" "$grace" "${docker[@]}" stop -t "$grace" "$container" 2>&1 <<'EOF'
import json, subprocess, sys, time, urllib.request
port, grace, stop = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
body = {"prompt": "JULIET:", "max_tokens": 400, "temperature": 0, "stream": True}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                             data=json.dumps(body).encode(), headers={"content-type": "application/json"})
chunks, done, stopping = 0, False, None
with urllib.request.urlopen(req, timeout=120) as r:
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        chunks += json.loads(line[6:])["choices"][0]["text"] != ""
        if stopping is None:
            t0, stopping = time.time(), subprocess.Popen(stop, stdout=subprocess.DEVNULL)
rc = stopping.wait() if stopping else None
took = time.time() - t0 if stopping else 0
if not (done and chunks > 1 and rc == 0 and took < grace):
    sys.exit(f"stream done={done} chunks={chunks}, docker stop rc={rc} in {took:.1f}s")
print(f"{took:.2f}s, the stream in flight finished ({chunks} chunks)")
EOF
) || fail "SIGTERM with a stream in flight: $drained"
code=$("${docker[@]}" inspect -f '{{.State.ExitCode}} {{.State.Running}}' "$container")
[ "$code" = "0 false" ] || fail "after SIGTERM the service's exit code, running: $code (137: killed at the end of the grace)"
"${docker[@]}" logs "$container" 2>&1 | grep -q "SIGTERM" || fail "the service did not log SIGTERM"
say "docker stop: exit 0 in $drained"

size=$("${docker[@]}" image inspect -f '{{.Size}}' "$tag")
now=$(date +%s)
echo "test-image: OK: $tag ($((size / 1000000)) MB) serves the binary's texts as uid 10001 and drains on SIGTERM" \
  "(build $((built - started)) s, checks $((now - built)) s)"
