#!/usr/bin/env bash
# Runs the CLI over a broad sweep of commands (every tests/cli case, every README `<!-- run: -->` block, and a
# sweep of estimate/timeline/plan/fit configurations in JSON and table form) and writes each command's stdout,
# stderr and exit code to OUTDIR, one file per command. Compare two such folders with `diff -r` to prove that a
# change (a speed-up) left every output byte unchanged:
#   bench/same_output.sh /tmp/before-trainmem /tmp/out.before; bench/same_output.sh build/trainmem /tmp/out.after
#   diff -r /tmp/out.before /tmp/out.after
set -u
exe=$(realpath "$1"); out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
n=0
run() {  # run DIR ARGS...: one command in DIR
  local dir=$1; shift
  n=$((n + 1))
  local f; f=$(printf '%s/%04d' "$out" "$n")
  printf '%s\n' "$*" > "$f.cmd"
  (cd "$dir" && "$exe" "$@" > "$f.out" 2> "$f.err"; echo $? > "$f.rc")
}
# 1. every tests/cli case (its args, in its folder)
for c in "$root"/tests/cli/*.case; do
  a=$(sed -n 's/^args: //p' "$c")
  eval "set -- $a"
  run "$root/tests/cli" "$@"
done
# 2. every README run block, without its pipe
grep -o '<!-- run: trainmem [^>]*-->' "$root/README.md" | sed -e 's/<!-- run: trainmem //' -e 's/ -->$//' -e 's/ |.*$//' |
while IFS= read -r a; do
  eval "set -- $a"
  run "$root" "$@"
done
# 3. a sweep, JSON and table, of estimates, timelines, fits and plans
E="estimate --format json"
L="--model llama-3-8b --set num_hidden_layers=4"
sweep=(
  "$E --model gpt2 --batch 2 --seq 256"
  "$E --model nanogpt-gpt2 --batch 4 --seq 512 --attention eager"
  "$E $L --batch 1 --seq 512 --precision bf16"
  "$E $L --batch 1 --seq 512 --checkpointing full"
  "$E $L --batch 1 --seq 512 --checkpointing selective"
  "$E $L --batch 1 --seq 512 --checkpointing full --checkpoint-reentrant true"
  "$E $L --batch 1 --seq 512 --checkpointing full --checkpoint-every 2"
  "$E $L --batch 1 --seq 512 --lora r=16,alpha=32 --checkpointing full"
  "$E $L --batch 1 --seq 512 --quantize nf4 --lora r=8"
  "$E $L --batch 1 --seq 512 --optimizer adamw8bit"
  "$E $L --batch 1 --seq 512 --optimizer sgd --optimizer-impl for-loop"
  "$E $L --batch 1 --seq 512 --grad-accum 3"
  "$E $L --batch 1 --seq 512 --loss chunked"
  "$E $L --batch 1 --seq 512 --loss liger-fused --precision bf16"
  "$E $L --batch 1 --seq 512 --alloc-conf expandable_segments:True"
  "$E $L --batch 1 --seq 512 --torch 2.3"
  "$E $L --batch 1 --seq 512 --torch 1.13"
  "$E $L --batch 1 --seq 512 --task inference"
  "$E $L --batch 2 --seq 128 --task inference --generate 8"
  "$E $L --batch 1 --seq 512 --dp 4"
  "$E $L --batch 1 --seq 512 --dp 4 --bucket-cap-mb 5 --gradient-as-bucket-view true"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding zero1 --precision bf16"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding zero2 --overlap-comm true --precision bf16"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding zero3 --precision bf16"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding zero3 --offload optimizer,params --precision bf16"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding fsdp1"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding fsdp1 --fsdp1-prefetch backward_pre"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding fsdp2"
  "$E $L --batch 1 --seq 512 --dp 4 --sharding fsdp2 --reshard-after-forward false --dp-rank 3"
  "$E $L --batch 1 --seq 512 --gpus 16xh100-80gb --sharding fsdp2 --checkpointing selective"
  "$E $L --batch 1 --seq 512 --tp 4"
  "$E $L --batch 1 --seq 512 --tp 4 --sequence-parallel true"
  "$E $L --batch 1 --seq 512 --tp 2 --dp 2 --sharding fsdp2"
  "$E $L --batch 1 --seq 512 --pp 2 --precision bf16"
  "$E $L --batch 1 --seq 512 --pp 2 --pp-schedule gpipe --micro-batches 4 --precision bf16"
  "$E $L --batch 1 --seq 512 --pp 2 --pp-schedule interleaved-1f1b --micro-batches 4 --precision bf16"
  "$E $L --batch 1 --seq 512 --pp 2 --tp 2 --dp 2 --sharding fsdp2 --micro-batches 4 --checkpointing selective --precision fp32"
  "$E $L --batch 1 --seq 512 --pp 2 --rank 1 --gpu h100-80gb --precision bf16"
  "$E --model tinyllama-1.1b --set num_hidden_layers=2 --batch 1 --seq 1024 --cp 4 --checkpointing full"
  "$E --model mixtral-8x7b --set num_hidden_layers=2 --batch 1 --seq 256 --ep 4 --moe-experts eager --precision bf16"
  "$E --model qwen3-30b-a3b --set num_hidden_layers=2 --batch 1 --seq 256 --moe-routing worst --precision bf16"
  "$E --model qwen2-0.5b --batch 2 --seq 256 --precision fp16-amp"
  "$E --model gemma-2-2b --set num_hidden_layers=2 --batch 1 --seq 256"
  "$E --model phi-2 --set num_hidden_layers=2 --batch 1 --seq 256"
  "$E --model falcon-rw-1b --set num_hidden_layers=2 --batch 1 --seq 256"
  "$E --model opt-125m --batch 2 --seq 256"
  "$E --model pythia-160m --batch 2 --seq 256"
  "$E --model bert-base-uncased --batch 4 --seq 128"
  "$E --model t5-small --batch 2 --seq 128 --target-seq 32"
  "$E --model tests/cli/data/llama_token_cls.json --batch 2 --seq 64"
  "$E --model qwen3-0.6b --batch 1 --seq 64 --loop plain --optimizer-in-backward true --precision bf16"
  "$E --model gpt2 --batch 1 --seq 64 --loop seed000"
  "timeline --format json $L --batch 1 --seq 256 --step 2"
  "timeline --format csv $L --batch 1 --seq 256 --by event"
  "timeline --format csv $L --batch 1 --seq 256 --pp 2 --tp 2 --dp 2 --sharding fsdp2 --micro-batches 4 --by event --precision fp32"
  "timeline --format csv $L --batch 1 --seq 256 --dp 4 --sharding zero3 --by event --precision bf16"
  "timeline --format csv $L --batch 1 --seq 256 --dp 4 --sharding fsdp1 --by phase"
  "timeline --format csv --model gpt2 --batch 1 --seq 128 --task inference --generate 4 --by event"
  "timeline $L --batch 1 --seq 256 --checkpointing selective --by layer"
  "fit $L --seq 512 --gpu rtx-4090 --format json"
  "fit $L --gpus 8xh100-80gb --seq 2048"
  "plan --model tinyllama-1.1b --gpus 8xa100-80gb --global-batch 16 --seq 1024 --format json"
  "plan --model qwen3-0.6b --gpus 4xh100-80gb --global-batch 8 --seq 2048"
  "estimate --model llama-3.1-70b --gpus 256xh100-80gb --tp 8 --pp 4 --sharding fsdp2 --precision fp32 --micro-batches 8 --batch 1 --seq 8192 --checkpointing selective --format json"
  "estimate --model llama-3.1-70b --gpus 64xh100-80gb --tp 8 --sharding fsdp2 --checkpointing selective --batch 1 --seq 8192 --format json"
  "estimate --model llama-3.1-70b --gpus 64xh100-80gb --sharding zero2 --batch 1 --seq 8192 --format json --precision bf16"
  "timeline --model llama-3.1-70b --gpus 32xh100-80gb --tp 8 --pp 4 --micro-batches 8 --batch 1 --seq 8192 --precision bf16 --checkpointing full --format csv --by event"
)
for a in "${sweep[@]}"; do
  eval "set -- $a"
  run "$root" "$@"
done
echo "$n commands -> $out"
