#!/usr/bin/env bash
# Two lists of bench/gpu.sh stages side by side on a two-GPU machine (device kind nvidia-h200-x2),
# one list per GPU, so one lease measures twice as much. Each stage sees only its own GPU
# (CUDA_VISIBLE_DEVICES); the start-up benchmark keeps its compile caches in its own folders, so
# the two lists share nothing but the host's 32 cores (each list uses at most ~6).
#
#   bash bench/gpu_pair.sh "startup startup-eager" "raw bundle"
#   bash bench/gpu_pair.sh "BENCH_CLIENTS=8 raw bundle" "bundle"   # NAME=value sets the environment
#                                                                 # of that list's later stages
#
# Logs go to bench/gpu-results/gpu<N>.log; everything under bench/gpu-results/ comes back as an
# archive per GPU, $OUT/gpu<N>.tgz, rewritten after each stage (the device tool returns at most 8
# files a call, and only what is there when a call is cut at its time limit).
set -uo pipefail
first=${1:-} second=${2:-}
if [ ! -d /tmp/site/vllm ]; then  # install once, before the two lists start
  bash .gpu/install.sh || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p bench/gpu-results
results=${OUT:-/tmp/out}
mkdir -p "$results"
run_list() {  # run_list GPU STAGES...
  local gpu=$1; shift
  for stage in "$@"; do
    if [[ $stage == *=* ]]; then export "${stage?}"; continue; fi  # NAME=value: for this list's later stages
    echo "=== GPU $gpu: $stage ($(date +%T))"
    # gpu.sh copies each stage's files to $OUT; here that is a folder inside the archive.
    OUT=bench/gpu-results/out$gpu CUDA_VISIBLE_DEVICES=$gpu bash bench/gpu.sh "$stage" \
      || echo "=== GPU $gpu: $stage FAILED"
    # After every stage, so a call cut at its time limit still returns what finished.
    tar czf "$results/gpu$gpu.tgz" bench/gpu-results /tmp/startup-work/*.log 2> /dev/null
  done
}
# shellcheck disable=SC2086  # the stage lists are meant to split into words
run_list 0 $first > bench/gpu-results/gpu0.log 2>&1 &
# shellcheck disable=SC2086
run_list 1 $second > bench/gpu-results/gpu1.log 2>&1 &
wait
tail -n 40 bench/gpu-results/gpu0.log bench/gpu-results/gpu1.log
