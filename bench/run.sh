#!/usr/bin/env bash
# The GPU benchmark and checks, run on the GPU machine from a folder holding the release
# binaries wasi-nn-host and wasi-nn-bench and gpt2.wasm (built elsewhere):
#   bench/run.sh DIR [checks|speed|all]
# Prints JSON lines: checks; then, in one call with the PyTorch peer (bench/torch_gpt2.py),
# our end-to-end and backend rows.
set -uo pipefail
dir=${1:-carry}
part=${2:-all}
B=$dir/wasi-nn-host
W=$dir/gpt2.wasm
C=$dir/wasi-nn-bench
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" != speed ]; then
  # correctness first: kernel sweep + whole models vs the CPU reference, and the full context
  $C check-cuda --model models/gpt2-shakespeare --model random:124M --prompt 16 --steps 64
  $C check-cuda --model random:124M --prompt 1000 --steps 24
  $C check-cuda --model random:1558M --prompt 16 --steps 64
  # 1558M with a long prompt: its prefill products run in several waves of blocks
  $C check-cuda --model random:1558M --prompt 1000 --steps 2
  # the full path: same greedy text on both devices
  for dev in cpu cuda; do
    $B run $W --device $dev -- --json --max-tokens 64 "ROMEO:" | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'what':'e2e_text','device':'$dev','ids':d['ids'],'text':d['text']}))"
  done
  # perplexity of the shakespeare model on TinyShakespeare's validation split (the last 10%)
  mkdir -p /tmp/ppl && tail -c +1011178 tests/data/tinyshakespeare.txt > /tmp/ppl/val.txt
  for dev in "cpu" "cuda --dtype f32" "cuda --dtype bf16"; do
    $B run $W --device $dev --dir /tmp/ppl::data -- --perplexity data/val.txt --window 512 | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'what':'perplexity','device':'$dev',**d}))"
  done
fi
if [ "$part" != checks ]; then
  # end to end through gpt2.wasm: greedy and top-p
  for size in 124M 1558M; do
    for dtype in f32 bf16; do
      for mode in greedy top_p; do
        args="--json --max-tokens 256"
        [ $mode = top_p ] && args="$args --temperature 1 --top-p 0.9 --seed 1"
        $B run $W --device cuda --dtype $dtype --graph gpt2=random:$size -- $args "The" | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'what':'e2e','size':'$size','dtype':'$dtype','mode':'$mode',**d['timings']}))"
      done
    done
  done
  # the headline row three more times (its median goes in the table)
  for i in 1 2 3; do
    $B run $W --device cuda --dtype bf16 --graph gpt2=random:124M -- --json --max-tokens 256 "The" | tail -1 | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({'what':'e2e','size':'124M','dtype':'bf16','mode':'greedy','repeat':$i,**d['timings']}))"
  done
  # backend-only decode at context 128 and ~1000, 1024-token prefill
  for size in 124M 355M 774M 1558M; do
    for dtype in f32 bf16; do
      $C bench --device cuda --dtype $dtype --model random:$size --context 128 --steps 30 --prefill 1024
      $C bench --device cuda --dtype $dtype --model random:$size --context 900 --steps 10
    done
  done
  python3 bench/torch_gpt2.py graph prefill
fi
