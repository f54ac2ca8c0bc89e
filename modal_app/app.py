"""Serve the bundle on Modal: `modal deploy modal_app/app.py`.

This file is a walk-through, read top to bottom: what gets deployed, then the image, the caches,
the class that Modal runs, and a smoke test. It translates the core's settings into Modal's
decorators and nothing more; everything about serving (the OpenAI-compatible API, streaming,
resume, auth, limits) lives in `shared/` and behaves the same here as on a laptop.

Every knob is a `BUNDLE_*` environment variable read by `shared.settings.Settings`, so one file
deploys many configurations:

    BUNDLE_MODEL=Qwen/Qwen2.5-7B-Instruct BUNDLE_MODAL_GPU=L40S modal deploy modal_app/app.py

Where the engine starts: snapshots and the event loop
-----------------------------------------------------
vLLM's `AsyncLLM` belongs to the event loop it starts on: its output handler is a task on that
loop and its engine-core sockets are asyncio sockets bound to it. So the engine must start on
the loop that later serves the HTTP requests. What the two ways of running this class do
(modal 1.6.4, read from its source):

- In a Modal container (`_container_entrypoint.py`, `_runtime/user_code_imports.py`) one
  `UserCodeEventLoop` runs everything in order: the `snap=True` enter hooks, the memory snapshot,
  (after a restore, from here on) the `snap=False` enter hooks, the `@modal.asgi_app()` method,
  the ASGI lifespan startup, every request, the lifespan shutdown, the exit hooks, the volume
  commit. A hook may be sync or async: Modal calls it, and if the call returns a coroutine it
  runs that coroutine to completion on this same loop.
- `.local()` on the sync `web` method (`_functions.py`, `Function.local` -> `Obj._enter`) calls
  every enter hook as a plain function and drops what it returns: an async hook's coroutine
  would never run. And whatever serves the returned app locally (uvicorn in the tests) runs its
  own loop, which no enter hook can know.

So, with snapshots on (`BUNDLE_MODAL_SNAPSHOT`, the default for one GPU), the hooks are plain
functions that return their coroutine only inside a container (`in_container`): there Modal
runs it on the serving loop, before the snapshot (start the engine, warm it up, put it to
sleep) and after each restore (wake it; a failed wake raises, and Modal ends the container so
that it is replaced).
The app's lifespan then assembles the service on that engine (`EngineLifecycle.engine_factory`
into `shared.assembly.start_service`, the one assembly the Cog runner uses too), without warming
it a second time. Under `.local()`
the hooks do nothing and the same lifespan starts an engine itself, on uvicorn's loop. With
snapshots off there are no hooks at all and the lifespan always starts the engine. Either way
the asleep engine is woken before the first request: the restore hook finishes before Modal
routes any input to the container. `python -m bench.modal_rehearsal` runs this class through
Modal's own lifecycle code on one loop, the way a container does, and times each phase.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import modal

from modal_app.caches import compile_cache_env
from modal_app.settings import ModalSettings
from shared.engine.presets import apply_preset
from shared.lifecycle import EngineLifecycle  # light: vLLM is imported only when an engine starts
from shared.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)

# --- What is deployed -----------------------------------------------------------------------
# Served when BUNDLE_MODEL is not set: an 8B instruct model whose FP8 weights (~9 GB) fit one
# H100 with room for a large KV cache. The revision is a commit of the Hugging Face repo, so a
# re-deploy months later serves the same weights (set BUNDLE_MODEL_REVISION to move it).
MODEL = "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8"
MODEL_REVISION = "12fd6884d2585dd4d020373e7f39f74507b31866"

# Read once, here, at import: the decorators below need plain values. The same variables are
# handed to the container (see `CONTAINER_ENV`), where this module is imported again and
# rebuilds the same settings, so the decorators and the engine can never disagree.
SETTINGS = Settings().with_default_model(MODEL, MODEL_REVISION).with_default_preset("throughput")
MODAL = ModalSettings()
# Modal's own runner serves the class's ASGI app in the container's one process: there is no port
# for several API processes to share (docs/modal.md, API processes). Refused, not ignored.
if SETTINGS.api_processes > 1:
    raise ValueError(
        f"BUNDLE_API_PROCESSES={SETTINGS.api_processes}: the Modal class serves one API process "
        "(Modal runs its ASGI app); unset it for this deploy"
    )

# One container accepts up to max_inputs streams and the autoscaler aims for target_inputs
# each; both default from the engine's max_num_seqs as its preset leaves it (the reasoning is in
# `ModalSettings.concurrency`). Continuous batching only pays when streams share the GPU.
MAX_INPUTS, TARGET_INPUTS = MODAL.concurrency(apply_preset(SETTINGS).max_num_seqs, SETTINGS.max_in_flight)

# --- The image ---------------------------------------------------------------------------------
# The GPU build of vLLM and the core's dependencies, pinned in one file that cog.yaml installs
# too (tests/test_pins.py checks pyproject.toml against it). One Python for both images.
PYTHON_VERSION = "3.12"
PINS_FILE = Path(__file__).resolve().parents[1] / "shared" / "requirements-deploy.txt"


def read_pins(path: Path = PINS_FILE) -> tuple[str, ...]:
    """The `name==version` lines of a requirements file, comments and blanks dropped."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line)


PACKAGES = read_pins()
image = (
    modal.Image.debian_slim(python_version=PYTHON_VERSION)
    .uv_pip_install(*PACKAGES)
    # The core as local source, mounted at container start (no rebuild when it changes).
    # .txt too: the built-in "tiny" model trains its tokenizer on shared/models/tiny_corpus.txt,
    # which makes BUNDLE_MODEL=tiny a cheap end-to-end deploy check.
    .add_local_python_source("shared", "bundle_client", ignore=~modal.FilePatternMatcher("**/*.py", "**/*.txt"))
)

# --- Caches that outlive containers -----------------------------------------------------------
# Weights download once per volume, not once per cold start; vLLM's torch.compile and CUDA-graph
# artifacts are reused the same way. The names are shared with other apps on purpose.
HF_CACHE_DIR = "/root/.cache/huggingface"
VLLM_CACHE_DIR = "/root/.cache/vllm"
hf_cache = modal.Volume.from_name("huggingface-cache", create_if_missing=True)
vllm_cache = modal.Volume.from_name("vllm-cache", create_if_missing=True)

# The container's environment: this deploy's BUNDLE_* settings (never the API key) plus the
# cache locations. Modal passes `env=` as a secret, so changing a setting rebuilds no image.
CONTAINER_ENV: dict[str, str | None] = {
    **SETTINGS.deploy_env(),
    **MODAL.deploy_env(),
    "HF_HOME": HF_CACHE_DIR,
    # vLLM's, inductor's and Triton's compiled artifacts, all on the volume (modal_app/caches.py).
    **compile_cache_env(VLLM_CACHE_DIR),
    # Also where LoRA adapters from tar URLs are unpacked (<cache dir>/lora; those from Hugging
    # Face land in HF_HOME): on the volume, so a fine-tune downloads once per volume, not per start.
    "BUNDLE_CACHE_DIR": f"{HF_CACHE_DIR}/vllm-serverless-bundle",
}


def _secrets(settings: Settings, modal_settings: ModalSettings) -> list[modal.Secret]:
    """The API key (and the Redis URL, which may hold a password) travel as a Modal Secret: a
    named one (holding BUNDLE_API_KEY, BUNDLE_REDIS_URL, and HF_TOKEN for gated models), or,
    if they are only set locally, one made from them at deploy."""
    if modal_settings.secret_name:
        return [modal.Secret.from_name(modal_settings.secret_name)]
    secret: dict[str, str | None] = {  # as `Secret.from_dict` types it (None: key left out)
        name: value.get_secret_value()
        for name, value in (("BUNDLE_API_KEY", settings.api_key), ("BUNDLE_REDIS_URL", settings.redis_url))
        if value is not None
    }
    return [modal.Secret.from_dict(secret)] if secret else []


# --- Cold starts: GPU memory snapshots ----------------------------------------------------------
# With snapshots, a new container is restored from memory with the engine already started,
# compiled, warmed up and asleep (weights in host memory, GPU nearly empty): it only wakes it.
# Modal takes snapshots only of deployed apps, after a few ordinary cold boots.
# Modal snapshots the GPU memory of single-GPU functions only: with several GPUs ("H100:2")
# snapshots are off unless asked for, and asking for them stops the deploy (`use_snapshots`).
SNAPSHOTS = MODAL.use_snapshots()
if MODAL.gpu_count > 1 and not SNAPSHOTS and "snapshot" not in MODAL.model_fields_set:
    log.warning(
        "BUNDLE_MODAL_GPU=%s: %d GPUs, so no GPU memory snapshots (Modal snapshots single-GPU "
        "functions only); every cold start starts the engine",
        MODAL.gpu,
        MODAL.gpu_count,
    )
SNAPSHOT_OPTIONS: dict[str, Any] = (
    {"enable_memory_snapshot": True, "experimental_options": {"enable_gpu_snapshot": True}} if SNAPSHOTS else {}
)

Work = Coroutine[Any, Any, Any]


def in_container(work: Callable[[], Work]) -> Work | None:
    """The coroutine for Modal to run on the container's serving loop, or None under `.local()`,
    where nothing would run it (see the module docstring)."""
    return None if modal.is_local() else work()


app = modal.App(MODAL.app_name)


# --- The server -------------------------------------------------------------------------------
@app.cls(
    image=image,
    gpu=MODAL.gpu,  # "H100", "L40S", "A100-80GB"; "H100:2" with tensor_parallel_size 2
    volumes={HF_CACHE_DIR: hf_cache, VLLM_CACHE_DIR: vllm_cache},
    env=CONTAINER_ENV,
    secrets=_secrets(SETTINGS, MODAL),
    # Idle seconds before a container stops: billed idle time against fewer cold starts.
    scaledown_window=MODAL.scaledown_window_s,
    # Longest single request (one HTTP request is one Modal input): bounds the longest stream.
    timeout=MODAL.timeout_s,
    # Cold start budget: weight download on a fresh volume, load, compile, CUDA graphs.
    startup_timeout=MODAL.startup_timeout_s,
    min_containers=MODAL.min_containers,
    max_containers=MODAL.max_containers,
    **SNAPSHOT_OPTIONS,
)
@modal.concurrent(max_inputs=MAX_INPUTS, target_inputs=TARGET_INPUTS)
class Server:
    lifecycle: EngineLifecycle | None = None  # set by the snapshot hooks
    web_app: FastAPI | None = None  # built before the snapshot, when there is one

    if SNAPSHOTS:

        @modal.enter(snap=True)
        def prepare_snapshot(self) -> Work | None:
            self.lifecycle = EngineLifecycle(SETTINGS)
            # The app is built here, before the snapshot, so that a restore finds the web stack
            # imported and the app made: built after the wake-up (in `web`) it cost 0.7 s between
            # the restore and the first token (bench/modal_rehearsal.py, CPU).
            self.web_app = _build_app(self.lifecycle)
            return in_container(self.lifecycle.prepare_for_snapshot)

        @modal.enter(snap=False)
        def wake_after_restore(self) -> Work | None:
            assert self.lifecycle is not None, "Modal runs the snap=True hooks first"
            return in_container(self.lifecycle.wake)

    @modal.asgi_app(requires_proxy_auth=MODAL.requires_proxy_auth)
    def web(self) -> FastAPI:
        return self.web_app if self.web_app is not None else _build_app(self.lifecycle)

    @modal.exit()
    def stop(self) -> Work | None:
        # Modal ran the lifespan shutdown before this hook: in-flight generations are aborted.
        # An engine the snapshot hook started is closed here, on the same loop.
        log.info("container stopping")
        if self.lifecycle is None or not self.lifecycle.started:
            return None
        return in_container(self.lifecycle.stop)


def _build_app(lifecycle: EngineLifecycle | None) -> FastAPI:
    """The core's app: on the snapshot hooks' engine when there is one, else the app's lifespan
    starts the engine. In a container, a dead engine retires the container."""
    from shared.http.api import create_app

    retire = None if modal.is_local() else _retire_container
    if lifecycle is None:
        return create_app(SETTINGS, request_exit=retire)
    return create_app(SETTINGS, engine_factory=lifecycle.engine_factory, request_exit=retire)


def _retire_container(code: int) -> None:
    """The engine died and the in-flight streams got their error events (shared/server_state.py):
    take no more inputs, so the container exits once the requests in hand end and Modal starts a
    fresh one, instead of a container that answers 503 until its scale-down window runs out."""
    import asyncio

    import modal.experimental

    log.error("the engine died (exit code %d): this container takes no more inputs", code)
    asyncio.get_running_loop().create_task(modal.experimental.stop_fetching_inputs.aio())


# --- Smoke test: `modal run modal_app/app.py` -------------------------------------------------
@app.local_entrypoint()
def smoke(prompt: str = "", max_tokens: int = 128) -> None:
    """Start a temporary copy of the app, check /health, stream one chat completion, time it."""
    import asyncio

    from modal_app.smoke import SMOKE_PROMPT, run_smoke

    url = Server().web.get_web_url()
    if url is None:
        raise RuntimeError("Modal gave the web endpoint no URL")
    print(f"serving {SETTINGS.model_name} at {url}")
    result = asyncio.run(run_smoke(url, SETTINGS, MODAL, prompt=prompt or SMOKE_PROMPT, max_tokens=max_tokens))
    print(result.text)
    print(result.summary())
