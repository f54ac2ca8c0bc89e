"""The bundle on Replicate: a Cog runner that streams tokens from the core's engine.

It only translates between Cog and the core (`shared/`); see docs/cog.md for deploying it.

How streaming AND concurrency work on cog/coglet 0.23.1 (the pinned version):
- `run()` is `async def` (coglet refuses COG_MAX_CONCURRENCY > 1 otherwise) and every async
  `run()`, like the async `setup()` that opened the engine, runs on ONE asyncio loop in coglet's
  worker. So the engine, its output handler and the request registry all live on that loop.
- `run()` is NOT an async generator: coglet 0.23.1 collects those whole and sends them at the
  end. It admits the generation (no awaiting, nothing blocking) and RETURNS a plain sync
  generator. Coglet iterates that in the prediction's own slot thread and sends every item the
  moment it is yielded. The generator waits for each piece with
  `run_coroutine_threadsafe(...).result()`, which parks only that slot thread (GIL released), so
  N predictions stream side by side while the loop keeps serving the engine.
- Cancel: coglet does not tell the generator, and a cancel that comes while run() is being
  submitted or is returning would leave its generation running; `cog_cancel` intercepts
  coglet's cancel whenever it comes and aborts the engine request (fragile, checked, explained
  there, with the one window only coglet can close).

dtype: on this bundle's CPU test machine an engine in bf16 started under coglet dies with SIGILL
at its first forward pass (the CPU has AMX, which Linux grants per process on request; inside
coglet's process tree that request evidently fails), while float32 works. The core's tiny model
is float32 (`shared.engine.vllm_startup._dtype`); real models on GPUs keep BUNDLE_DTYPE (default "auto").

Forked children (vLLM's engine core on GPUs): see cog/child_output.py.

Settings: coglet 0.23.1 passes its own environment to the worker (measured), so BUNDLE_* work
locally, and in an image built by `cog build` from cog.yaml's `environment:`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# coglet loads this file by path (cog.predictor.load_predictor_from_ref: spec_from_file_location),
# which puts neither this folder nor the repository root on sys.path; and this folder cannot be a
# package, since `import cog` is the Cog SDK. So the Cog-side modules beside this file (cog_bridge,
# cog_inputs, cog_cancel, coglet_internals, child_output, cog_schema) are top-level modules found
# through this folder, and the root comes first so that `shared` is this checkout's, not another
# installed copy.
for _folder in (Path(__file__).resolve().parent, Path(__file__).resolve().parent.parent):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import asyncio
import contextlib
from collections.abc import Iterator

import child_output
import cog_bridge as bridge
import cog_cancel
import cog_inputs as inputs
import coglet
import coglet_internals

import cog
from cog import BaseRunner, CancelationException, ConcatenateIterator, Input
from shared.assembly import prepare_start, start_service
from shared.cache.layout import with_default_root

CANCEL_HOOK_INSTALLED = cog_cancel.install_coglet_cancel_hook()  # before coglet submits the first run()
# Before setup() forks vLLM's engine core: the child gets plain stdout/stderr that reach coglet's
# log (coglet's own stream objects die with fork; why in cog/child_output.py).
child_output.give_forked_children_plain_streams(under_coglet=coglet.server.active)


class Runner(BaseRunner):
    # Coglet awaits an async setup; the SDK's BaseRunner declares only the sync form.
    async def setup(self, weights: Path | str | None = None) -> None:  # type: ignore[override]
        # Runs on coglet's shared loop, so the engine's output handler does too. A failure here
        # propagates: coglet reports SETUP_FAILED and never serves a prediction.
        # COG_WEIGHTS may be a URL of a .tar to download and unpack (minutes for a real model),
        # and BUNDLE_COMPILE_CACHE a compile-cache pack's URL: both are fetched in threads while
        # a third imports vLLM, so coglet's loop stays free and the import costs no extra time.
        # The caches always live in one root under the cache dir, so that this container's
        # start can be packed and shipped to the next (docs/cog.md, "Cold boot").
        bridge.send_core_logs_to_stderr()  # the download's progress reaches the setup log
        # What cancels rely on of coglet's internals, checked against this coglet: one line, and
        # the service's metrics (`bundle_server_features`).
        internals = await asyncio.to_thread(coglet_internals.detect, hook_installed=CANCEL_HOOK_INSTALLED)
        coglet_internals.log_found(internals)
        base = with_default_root(bridge.runner_settings(None))
        settings = await prepare_start(base, str(weights) if weights else None)
        self._stack = contextlib.AsyncExitStack()
        # The core's one assembly, as the HTTP server's: engine, death guard and watchdog, loop
        # lag, identity (shared across instances with BUNDLE_REDIS_URL), and the warm-up before
        # READY: on the H200 the first 32-prediction wave waited ~7 s for vLLM's top-k/top-p
        # Triton kernel without it, which Cog's default inputs need (docs/cog.md).
        self.service = await self._stack.enter_async_context(start_service(settings))
        self.service.metrics.show_server_features(internals.found)
        self.loop = asyncio.get_running_loop()

    def healthcheck(self) -> bool:
        # coglet 0.23.1 calls this from a thread pool for GET /health-check; False -> UNHEALTHY.
        # After engine death this is ALL the runner does: unlike the HTTP server it does not exit.
        # Measured: coglet outlives an exited worker (no exit code, still UNHEALTHY, never
        # DEFUNCT) and then fails predictions with "Broken pipe", later 409 "at capacity",
        # instead of the engine's reason. docs/cog.md, "Engine death", has the figures.
        return bridge.engine_healthy(self.service)

    @cog.streaming
    @cog.concurrent(max=32)  # a literal: `cog build` reads it from the source; = cog.yaml's
    async def run(
        self,
        # Names, defaults and order follow Replicate's LLM models (cog-vllm, the official Llama
        # ones); json_schema, tools and request_id are this bundle's own.
        prompt: str = Input(description="The user message.", min_length=1),
        # Replicate's Llama models default to "You are a helpful assistant"; empty here because
        # a default system message changes every answer, and some models' chat templates
        # refuse a system role (every prediction would fail).
        system_prompt: str = Input(default="", description="System message; empty for none."),
        max_tokens: int = Input(
            default=inputs.DEFAULT_MAX_TOKENS,
            ge=1,
            le=inputs.MAX_TOKENS_LIMIT,
            description="Most tokens to generate. Left at the default, it shrinks to what the "
            "context leaves after a long prompt.",
        ),
        min_tokens: int = Input(
            default=0,
            ge=0,
            le=inputs.MAX_TOKENS_LIMIT,
            description="Fewest tokens to generate: the end of text and stop sequences are "
            "ignored before that.",
        ),
        temperature: float = Input(
            default=inputs.DEFAULT_TEMPERATURE,
            ge=inputs.TEMPERATURE_RANGE[0],
            le=inputs.TEMPERATURE_RANGE[1],
            description="0 is greedy.",
        ),
        top_p: float = Input(
            default=inputs.DEFAULT_TOP_P,
            ge=inputs.TOP_P_MIN,
            le=1.0,
            description="Nucleus sampling mass, above 0.",
        ),
        top_k: int = Input(
            default=inputs.DEFAULT_TOP_K,
            ge=0,
            le=inputs.TOP_K_MAX,
            description="Most likely tokens kept; 0 disables.",
        ),
        presence_penalty: float = Input(default=0.0, ge=inputs.PENALTY_RANGE[0], le=inputs.PENALTY_RANGE[1]),
        frequency_penalty: float = Input(default=0.0, ge=inputs.PENALTY_RANGE[0], le=inputs.PENALTY_RANGE[1]),
        stop_sequences: str = Input(
            default="",
            description="Strings that end the generation (up to "
            f"{inputs.MAX_STOP_SEQUENCES}), whitespace kept: comma-separated, or a JSON list of "
            'strings such as ["\\n", " User:"] when a stop holds a comma.',
        ),
        prompt_template: str = Input(
            default="",
            description="Raw prompt with {prompt} and {system_prompt} filled in, sent to the model "
            "as it is; empty to use the model's own chat template.",
        ),
        seed: int | None = Input(
            default=None, ge=0, le=inputs.SEED_MAX, description="Omit for random sampling."
        ),
        json_schema: str = Input(
            default="",
            description="Structured output: a JSON schema (as a string) the output must validate "
            "against; empty for free text.",
        ),
        tools: str = Input(
            default="",
            description="OpenAI tool definitions as a JSON list, rendered into the prompt; the "
            "output is the model's own text, tool calls in its own format (Llama 3.1: JSON).",
        ),
        request_id: str = Input(
            default="",
            max_length=inputs.REQUEST_ID_MAX_LENGTH,
            description="Idempotency key: a repeat with the same inputs follows the same "
            "generation instead of starting another.",
        ),
        lora: str = Input(
            default="",
            description="LoRA adapter to run the prompt through: an https URL of a .tar of a PEFT "
            "adapter (adapter_config.json + weights), a Hugging Face id, or the name of an adapter "
            "loaded at start; downloaded once per container. Empty: the base model.",
        ),
    ) -> ConcatenateIterator[str]:
        signal = cog_cancel.current_cancel_signal(under_coglet=coglet.server.active)
        scope = self.scope  # this prediction's; the generator below ends in coglet's slot thread
        for key, value in bridge.engine_metrics(self.service).items():
            scope.record_metric(key, value)
        body = inputs.request_from_inputs(
            self.service.settings,
            prompt=prompt,
            system_prompt=system_prompt,
            prompt_template=prompt_template,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            stop_sequences=stop_sequences,
            seed=seed,
            json_schema=json_schema,
            tools=tools,
        )
        body = await bridge.with_adapter(self.service, body, lora)
        # Bad input raises a BundleError here: coglet turns it into a failed prediction. From
        # here on a cancel leaves the generation, wherever this run() is when it comes.
        subscription = await bridge.start_generation(self.service, body, request_id, signal)
        pieces: Iterator[str] = bridge.stream_text(
            subscription, self.loop, CancelationException, signal, record=scope.record_metric
        )
        return pieces  # type: ignore[return-value]  # coglet streams a returned sync generator
