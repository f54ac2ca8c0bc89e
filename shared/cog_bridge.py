"""Core-side helpers for the Cog runner (`cog/predict.py`); this module imports without cog.

The runner only translates: Cog inputs -> an OpenAI request (`chat_request_from_inputs`), the
core's generation -> a plain iterator of text pieces (`stream_text`), coglet's cancel -> an engine
abort (`install_coglet_cancel_hook`), coglet's health check -> `Engine.healthy`.

Threads, because that is how coglet 0.23.1 runs an async runner: every async `run()` (and the
async `setup()` that opened the engine) runs on ONE asyncio loop in the worker. A `run()` that
returns a *sync* generator gets it iterated in the prediction's own slot thread, each item sent as
soon as it is yielded. So the engine and the registry live on coglet's loop, and the iterator built
here hops onto that loop for every piece (`run_coroutine_threadsafe(...).result()`), which blocks
only its own slot thread (and releases the GIL while it waits): N predictions stream at once.
Registry calls are not thread-safe, so they too go through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any

import orjson

from shared.errors import Cancelled, InvalidRequest
from shared.protocol import (
    MAX_STOP_SEQUENCES,
    PENALTY_RANGE,
    REQUEST_ID_MAX_LENGTH,
    SEED_MAX,
    TEMPERATURE_RANGE,
    ChatCompletionRequest,
    parse_request,
)
from shared.service import Service, Subscription
from shared.settings import Settings

__all__ = [  # the protocol's bounds, re-exported for cog/predict.py's Input() declarations
    "MAX_STOP_SEQUENCES",
    "PENALTY_RANGE",
    "REQUEST_ID_MAX_LENGTH",
    "SEED_MAX",
    "TEMPERATURE_RANGE",
]

log = logging.getLogger(__name__)

# --- input bounds --------------------------------------------------------------------------
# The runner's Input(ge=, le=) bounds. The sampling bounds are the protocol's own constants; the
# token limits come from the core's *defaults*, not from this process's environment: the bounds
# end up in `.cog/openapi_schema.json`, a build artefact that must not change with the machine
# that generated it. A deploy that lowers a limit through BUNDLE_* still gets it enforced by the
# core at admission (a failed prediction saying why).
_DEFAULTS = Settings.model_fields
MAX_TOKENS_LIMIT: int = _DEFAULTS["max_tokens_limit"].default
DEFAULT_MAX_TOKENS: int = _DEFAULTS["default_max_tokens"].default
# The protocol takes top_p in (0, 1]. Cog's Input has only inclusive bounds (ge/le), so the
# schema's floor is the smallest value we accept rather than 0: 0 gets 422, never the engine.
TOP_P_MIN = 0.001
TOP_K_MAX = 1_000_000  # the protocol has no upper bound (any vocabulary); Cog's schema wants one


def runner_settings(weights: str | None, base: Settings | None = None) -> Settings:
    """The bundle's settings, with the model taken from Cog's weights when it passed any.

    Cog hands `setup()` the value of `COG_WEIGHTS` (a path or URL of weights baked into or
    mounted on the image); otherwise the model comes from BUNDLE_MODEL as everywhere else.
    """
    settings = base or Settings()
    if weights:
        return settings.model_copy(update={"model": str(weights)})
    return settings


def split_stop_sequences(value: str | Sequence[str] | None) -> list[str] | None:
    """'a,b' or ['a', 'b'] -> ['a', 'b']; blanks dropped; None when nothing is left."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    stops = [part.strip() for part in parts if part.strip()]
    return stops or None


def chat_request_from_inputs(
    settings: Settings,
    *,
    prompt: str,
    system_prompt: str = "",
    max_tokens: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    stop_sequences: str | Sequence[str] | None = None,
    seed: int | None = None,
    json_schema: str = "",
    tools: str = "",
) -> ChatCompletionRequest:
    """The OpenAI chat request a Cog prediction stands for, validated like an HTTP body.

    `stream` is False: the Cog path reads plain text (`Generation.follow_text`), not SSE events.
    Problems raise `InvalidRequest`, which the runner lets through as a failed prediction.
    """
    messages = [{"role": "user", "content": prompt}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    body: dict[str, Any] = {
        "model": settings.model_name,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k or None,  # Cog inputs need a number; 0 is "off" like vLLM's own 0/-1
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "stop": split_stop_sequences(stop_sequences),
        "seed": seed,
        "stream": False,
        "response_format": _schema_format(json_schema),
        "tools": _json_input(tools, "tools") if tools.strip() else None,
    }
    return parse_request(ChatCompletionRequest, body)


async def with_adapter(service: Service, body: ChatCompletionRequest, lora: str) -> ChatCompletionRequest:
    """`body` run on the LoRA adapter Cog's `lora` input names (a URL of a tar, a Hugging Face
    id, a local path, or the name of a start-time adapter), loaded into the engine the first time
    this container sees it (shared/lora.py, `Adapters.ensure`); empty: the base model."""
    if not lora.strip():
        return body
    name = await service.adapters.ensure(lora)
    return body.model_copy(update={"model": name})


def _json_input(text: str, name: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid JSON: {exc}", param=name) from None


def _schema_format(json_schema: str) -> dict[str, Any] | None:
    """Cog's `json_schema` string -> an OpenAI response_format, validated like the HTTP API's."""
    if not json_schema.strip():
        return None
    schema = _json_input(json_schema, "json_schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}


# --- coglet's cancel -> the prediction ------------------------------------------------------
# Why a hook at all: for an async run() coglet 0.23.1 implements POST /predictions/{id}/cancel
# as `.cancel()` on the concurrent.futures.Future it got from
# `asyncio.run_coroutine_threadsafe(_ctx_wrapper(run(...)), loop)`. Once run() has returned its
# generator that future is already done, so the cancel is a no-op for user code: coglet neither
# closes nor throws into the generator and keeps iterating it to the end (measured: 40 of 40
# items after a cancel at 0.6 s; status "canceled" only at the end). Nor does it call any
# `cancel` method of the runner. The only seam is that coglet looks `run_coroutine_threadsafe`
# up on the asyncio module at call time, so we wrap it: for coglet's own wrapper coroutine we
# (1) submit it in a context carrying a fresh `CancelSignal` (the task, hence run(), inherits
# that context) and (2) wrap the returned future's `.cancel` to fire the signal first.
#
# FRAGILE by nature: it depends on coglet internals (the function it calls, the name of its
# wrapper coroutine, the fact that it cancels through that future). Every assumption is checked
# and a broken one is logged as a warning; the effect is then only that a cancelled prediction's
# engine request runs to its end, as it would with no hook at all. Remove this when coglet
# propagates cancellation to generators (see docs/cog.md).
COGLET_RUN_WRAPPER = "_ctx_wrapper"


class CancelSignal:
    """Fired once from coglet's thread; callbacks added after firing run at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.fired = False

    def add(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self.fired:
                self._callbacks.append(callback)
                return
        callback()

    def fire(self) -> None:
        with self._lock:
            if self.fired:
                return
            self.fired = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a failing callback must not break coglet's cancel path
                log.exception("cancel callback failed")


_current_signal: contextvars.ContextVar[CancelSignal | None] = contextvars.ContextVar(
    "bundle_cog_cancel_signal", default=None
)
_hook_state = {"installed": False, "warned": False}
_plain_submit = asyncio.run_coroutine_threadsafe


def install_coglet_cancel_hook() -> bool:
    """Wrap asyncio.run_coroutine_threadsafe once; False (and a warning) if it can't be done."""
    if _hook_state["installed"]:
        return True
    if asyncio.run_coroutine_threadsafe is not _plain_submit:
        log.warning(
            "asyncio.run_coroutine_threadsafe is already replaced by someone else; Cog cancel "
            "will not abort engine requests early"
        )
        return False
    asyncio.run_coroutine_threadsafe = _submit_with_cancel_signal  # type: ignore[assignment]
    _hook_state["installed"] = True
    return True


def _submit_with_cancel_signal(
    coro: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop
) -> concurrent.futures.Future[Any]:
    if getattr(getattr(coro, "cr_code", None), "co_name", None) != COGLET_RUN_WRAPPER:
        return _plain_submit(coro, loop)  # not coglet submitting a run(): untouched
    signal = CancelSignal()
    context = contextvars.copy_context()
    context.run(_current_signal.set, signal)
    # call_soon_threadsafe copies the *calling* context and the task copies that: run() sees it.
    future = context.run(_plain_submit, coro, loop)
    plain_cancel = future.cancel

    def cancel() -> bool:
        signal.fire()
        return plain_cancel()

    future.cancel = cancel  # type: ignore[method-assign]
    return future


def current_cancel_signal(*, under_coglet: bool) -> CancelSignal | None:
    """This run()'s signal; None (with one warning) when coglet did not go through the hook."""
    signal = _current_signal.get()
    if signal is None and under_coglet and not _hook_state["warned"]:
        _hook_state["warned"] = True
        log.warning(
            "coglet did not submit run() through asyncio.run_coroutine_threadsafe(%s(...)) as "
            "coglet 0.23.1 does (hook installed: %s); POST /predictions/{id}/cancel will not "
            "abort the engine request, which then runs to its end",
            COGLET_RUN_WRAPPER,
            _hook_state["installed"],
        )
    return signal


# --- a generation as a blocking iterator ------------------------------------------------------
async def start_chat(service: Service, body: ChatCompletionRequest, request_id: str | None) -> Subscription:
    """Open (or re-attach to, same request_id) a generation and wait until its prompt passed
    every check (bad input raises here: a failed prediction); run on the engine's loop."""
    subscription = service.open("chat", body, request_id or None)
    try:
        await subscription.admitted()
    except BaseException:
        subscription.close()
        raise
    return subscription


async def _next(pieces: AsyncIterator[str]) -> str:
    return await anext(pieces)


async def _close(pieces: AsyncIterator[str]) -> None:
    aclose = getattr(pieces, "aclose", None)  # follow_text is an async generator
    if aclose is not None:
        await aclose()


def stream_text(
    subscription: Subscription,
    loop: asyncio.AbstractEventLoop,
    cancelled: Callable[[], BaseException],
    signal: CancelSignal | None = None,
) -> Iterator[str]:
    """Yield the generation's text as it grows; run in a thread other than `loop`'s.

    Each item is everything generated since the previous one: a reader that keeps up gets one
    token per item; one that falls behind (a loaded host) gets its backlog at once, so the slot
    thread and coglet's IPC do not spin per token while the GIL is scarce.
    Any early exit (a cancel, the consumer closing us, an error while sending) aborts the
    engine request; the subscription is always released. `cancelled()` builds the exception
    raised when the generation ends because of a cancel (the runner passes Cog's).
    """
    if signal is not None:
        signal.add(lambda: loop.call_soon_threadsafe(subscription.abandon))
    pieces = subscription.text()
    complete = False
    try:
        while True:
            try:
                piece = _plain_submit(_next(pieces), loop).result()
            except StopAsyncIteration:
                complete = True
                return
            except Cancelled as exc:
                raise cancelled() from exc
            yield piece
    finally:
        loop.call_soon_threadsafe(subscription.close if complete else subscription.abandon)
        _plain_submit(_close(pieces), loop)  # fire and forget: nothing waits on it


# --- health and observability -------------------------------------------------------------
def engine_healthy(service: Service) -> bool:
    """The engine's own liveness flag, read in coglet's health-check thread.

    No hop onto the engine's loop: coglet's worker waits for the answer before it dispatches
    the next prediction, and Replicate probes health all the time, so a check queued behind a
    busy loop would delay predictions (and could time out into UNHEALTHY under load)."""
    if service.healthy():
        return True
    log.error("engine health check failed: the engine is not running")
    return False


def engine_metrics(service: Service) -> dict[str, int]:
    """Engine-side figures a prediction reports in its `metrics` (read before it is admitted).

    `engine_running_requests` is vLLM's own count of unfinished requests: the ground truth a
    caller (or a test) can use to see that a cancelled prediction left nothing running.
    """
    return {"engine_running_requests": service.engine.running_requests()}
