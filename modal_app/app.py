"""Serve the bundle on Modal: `modal deploy modal_app/app.py`.

This file is a walk-through, read top to bottom: what gets deployed, then the image, the caches,
the class that Modal runs, and a smoke test. It translates the core's settings into Modal's
decorators and nothing more; everything about serving (the OpenAI-compatible API, streaming,
resume, auth, limits) lives in `shared/` and behaves the same here as on a laptop.

Every knob is a `BUNDLE_*` environment variable read by `shared.settings.Settings`, so one file
deploys many configurations:

    BUNDLE_MODEL=Qwen/Qwen2.5-7B-Instruct BUNDLE_MODAL_GPU=L40S modal deploy modal_app/app.py

Where the engine starts, and why not in `@modal.enter()`
--------------------------------------------------------
vLLM's `AsyncLLM` belongs to the event loop it starts on: its output handler is a task on that
loop and its engine-core sockets are asyncio sockets bound to it. So the engine must start on
the loop that later serves the HTTP requests. What the two ways of running this class do
(modal 1.6.4, read from its source):

- In a Modal container (`_container_entrypoint.py`, `_runtime/user_code_imports.py`) one
  `UserCodeEventLoop` runs everything in order: enter hooks (an async hook is run to completion
  on it), the `@modal.asgi_app()` method, the ASGI lifespan startup, then every request, then the
  lifespan shutdown, then exit hooks, then the volume commit. An async enter hook would work.
- `.local()` on the sync `web` method (`_functions.py`, `Function.local` -> `Obj._enter`) calls
  each enter hook as a plain function: an async hook's coroutine is created and never awaited,
  so the engine would silently never start. And whatever serves the returned app locally
  (uvicorn in the tests) runs its own loop, which no enter hook can know.

The one design correct in both places: the enter hook only builds the app (sync, no engine), and
the core app's own lifespan opens the engine (`create_app(settings)` without `engine=`). The
lifespan runs on whichever loop serves requests: Modal's loop in a container, uvicorn's locally.
The exit hook runs after the lifespan has closed the engine (Modal's order, above), so it has
no engine left to stop; Modal commits the volumes itself after it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import modal

from modal_app.settings import ModalSettings
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

# One container accepts up to max_inputs streams and the autoscaler aims for target_inputs
# each; both default from the engine's max_num_seqs (the reasoning is in
# `ModalSettings.concurrency`). Continuous batching only pays when streams share the GPU.
MAX_INPUTS, TARGET_INPUTS = MODAL.concurrency(SETTINGS.max_num_seqs)

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
    # .txt too: the built-in "tiny" model trains its tokenizer on shared/tiny_corpus.txt,
    # which makes BUNDLE_MODEL=tiny a cheap end-to-end deploy check.
    .add_local_python_source("shared", ignore=~modal.FilePatternMatcher("**/*.py", "**/*.txt"))
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
    "VLLM_CACHE_ROOT": VLLM_CACHE_DIR,
    "BUNDLE_CACHE_DIR": f"{HF_CACHE_DIR}/vllm-serverless-bundle",
}


def _secrets(settings: Settings, modal_settings: ModalSettings) -> list[modal.Secret]:
    """The API key travels as a Modal Secret: a named one (holding BUNDLE_API_KEY, and HF_TOKEN
    for gated models), or, if only BUNDLE_API_KEY is set locally, one made from it at deploy."""
    if modal_settings.secret_name:
        return [modal.Secret.from_name(modal_settings.secret_name)]
    if settings.api_key is not None:
        return [modal.Secret.from_dict({"BUNDLE_API_KEY": settings.api_key.get_secret_value()})]
    return []


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
)
@modal.concurrent(max_inputs=MAX_INPUTS, target_inputs=TARGET_INPUTS)
class Server:
    @modal.enter()
    def build(self) -> None:
        # Sync on purpose (see the module docstring): the engine starts in the app's lifespan,
        # on the loop that serves requests. Imported here so deploying needs no FastAPI.
        from shared.api import create_app

        self.api = create_app(SETTINGS)

    @modal.asgi_app(requires_proxy_auth=MODAL.requires_proxy_auth)
    def web(self) -> FastAPI:
        return self.api

    @modal.exit()
    def stop(self) -> None:
        # Modal ran the lifespan shutdown before this hook: in-flight generations are aborted
        # and the engine (with its child process) is closed. Nothing is left to release.
        log.info("container stopping; the engine was closed by the app's lifespan")


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
