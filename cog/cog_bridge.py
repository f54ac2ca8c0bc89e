"""The core's side of the Cog runner (`cog/predict.py`): its settings and logs, a generation as a
plain iterator for coglet's slot thread, the engine's health. Imports without cog.

The runner only translates: Cog inputs -> an OpenAI request (cog/cog_inputs.py), the core's
generation -> a plain iterator of text pieces (`stream_text`), left whenever the prediction's
cancel signal fires (cog/cog_cancel.py), coglet's health check -> `Engine.healthy`.

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
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from cog_cancel import CancelSignal, plain_submit
from cog_inputs import DEFAULT_MAX_TOKENS, cog_input_names

from shared.errors import Cancelled, EngineUnavailable
from shared.models.weights import resolve_weights
from shared.schemas import ChatCompletionRequest, CompletionRequest
from shared.service import Service, Subscription
from shared.settings import Settings
from shared.streaming import Kind

log = logging.getLogger(__name__)


# Loggers whose INFO lines belong in the setup log: the core's, and the check of coglet's internals.
SETUP_LOGGERS = ("shared", "coglet_internals")


def send_core_logs_to_stderr(level: str | None = None) -> None:
    """Let the core's own log lines (the weights download's progress, above all) reach the
    setup log: coglet forwards what its worker writes to stderr, but nothing in the worker
    configures Python's logging, so INFO lines would be dropped. Idempotent."""
    for name in SETUP_LOGGERS:
        logger = logging.getLogger(name)
        if not any(getattr(handler, "bundle_cog", False) for handler in logger.handlers):
            handler = logging.StreamHandler()  # stderr
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            handler.bundle_cog = True  # type: ignore[attr-defined]
            logger.addHandler(handler)
        logger.setLevel((level or Settings().log_level).upper())


def runner_settings(weights: Path | str | None, base: Settings | None = None) -> Settings:
    """The bundle's settings for the Cog runner; the model taken from Cog's weights if given.

    Cog hands `setup()` the value of `COG_WEIGHTS`: on Replicate usually the URL of a `.tar` of
    weights, fetched and unpacked here into the settings' cache (shared/models/weights.py; blocking,
    so call it off the event loop); a local path or a Hugging Face id is served as it is.
    Without weights the model comes from BUNDLE_MODEL as everywhere else.

    `default_max_tokens` becomes the Cog input's default: coglet fills in a default before
    `run()` sees the inputs, so "left at 512" is the only "not set" a prediction can say, and
    the core then shrinks it to what the context leaves (see `cog_inputs.request_from_inputs`).
    """
    settings = base or Settings()
    update: dict[str, Any] = {"default_max_tokens": min(DEFAULT_MAX_TOKENS, settings.max_tokens_limit)}
    if weights:
        update["model"] = resolve_weights(str(weights), settings.cache_dir)
    return settings.model_copy(update=update)


async def with_adapter(
    service: Service, body: ChatCompletionRequest | CompletionRequest, lora: str
) -> ChatCompletionRequest | CompletionRequest:
    """`body` run on the LoRA adapter Cog's `lora` input names (a URL of a tar, a Hugging Face
    id, a local path, or the name of a start-time adapter), loaded into the engine the first time
    this container sees it (shared/engine/lora.py, `Adapters.ensure`); empty: the base model."""
    if not lora.strip():
        return body
    name = await service.adapters.ensure(lora)
    return body.model_copy(update={"model": name})


# --- a generation as a blocking iterator ------------------------------------------------------
async def start_generation(
    service: Service,
    body: ChatCompletionRequest | CompletionRequest,
    request_id: str | None,
    signal: CancelSignal | None = None,
) -> Subscription:
    """Open (or re-attach to, same request_id) a generation and wait until its prompt passed
    every check (bad input raises here, naming the Cog input: a failed prediction); run on the
    engine's loop. From the moment it is opened, the prediction's cancel `signal` leaves it
    (aborted unless another prediction or client still reads it), wherever run() then is."""
    kind: Kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
    with cog_input_names(template=kind == "completion"):
        _check_engine_alive(service)
        subscription = await _open_to_the_end(service, kind, body, request_id or None)
        if signal is not None:
            loop = asyncio.get_running_loop()
            signal.add(lambda: _leave_later(loop, subscription))
        try:
            await subscription.admitted()
        except BaseException:  # refused, or cancelled while a long prompt was rendered
            subscription.abandon()
            raise
    return subscription


async def _open_to_the_end(
    service: Service, kind: Kind, body: ChatCompletionRequest | CompletionRequest, request_id: str | None
) -> Subscription:
    """`service.open`, carried to its end even when the prediction is cancelled meanwhile: cut
    half-way, a claim in a shared store could stay with nothing behind it, or a generation could
    start that no reader holds. What it opens after a cancel is left at once instead."""
    opening = asyncio.ensure_future(service.open(kind, body, request_id))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_leave_opened)
        raise


def _leave_opened(opening: asyncio.Future[Subscription]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().abandon()


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
    record: Callable[[str, int], None] | None = None,
) -> Iterator[str]:
    """The generation's text as a plain iterator for coglet's slot thread (`_text_pieces`), which
    leaves the generation if it is dropped without being read to its end."""
    pieces = _text_pieces(subscription, loop, cancelled, signal, record)
    # A generator that never started has no `finally` to run: dropped unread (coglet failed the
    # prediction before iterating it), it would leave the generation running for nobody.
    finalizer = weakref.finalize(pieces, _leave_later, loop, subscription)
    finalizer.atexit = False
    return pieces


def _leave_later(loop: asyncio.AbstractEventLoop, subscription: Subscription) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
        loop.call_soon_threadsafe(subscription.abandon)  # a no-op once the reader has closed


def _text_pieces(
    subscription: Subscription,
    loop: asyncio.AbstractEventLoop,
    cancelled: Callable[[], BaseException],
    signal: CancelSignal | None,
    record: Callable[[str, int], None] | None,
) -> Iterator[str]:
    """Yield the generation's text as it grows; run in a thread other than `loop`'s.

    Each item is everything generated since the previous one: a reader that keeps up gets one
    token per item; one that falls behind (a loaded host) gets its backlog at once, so the slot
    thread and coglet's IPC do not spin per token while the GIL is scarce.
    Any early exit (a cancel, the consumer closing us, an error while sending) aborts the
    engine request; the subscription is always released. `cancelled()` builds the exception
    raised when the generation ends because of a cancel (the runner passes Cog's). `record`
    (the prediction's metric recorder) gets the token counts once the text ends, however it ends.
    """
    # The wait in flight, cancelled by the signal: a reader that does not own the generation
    # (another prediction's, or another replica's) is only closed by `abandon`, so without this
    # its slot thread would wait for the generation's next piece, or its end.
    waiting: list[concurrent.futures.Future[str]] = []
    if signal is not None:
        signal.add(lambda: _stop_reading(loop, subscription, waiting))
    pieces = subscription.text()
    complete = False
    try:
        while True:
            if signal is not None and signal.fired:
                raise cancelled()
            waiting[:] = [plain_submit(_next(pieces), loop)]
            if signal is not None and signal.fired:  # fired before the wait was listed
                waiting[0].cancel()
            try:
                piece = waiting[0].result()
            except StopAsyncIteration:
                complete = True
                return
            except (Cancelled, concurrent.futures.CancelledError) as exc:
                raise cancelled() from exc
            yield piece
    finally:
        loop.call_soon_threadsafe(subscription.close if complete else subscription.abandon)
        plain_submit(_close(pieces), loop)  # fire and forget: nothing waits on it
        if record is not None:
            record_token_counts(subscription, record)


def _stop_reading(
    loop: asyncio.AbstractEventLoop, subscription: Subscription, waiting: list[concurrent.futures.Future[str]]
) -> None:
    """The cancel signal (coglet's thread): leave the generation (aborted if this was its last
    reader here) and end the wait for its next piece now."""
    loop.call_soon_threadsafe(subscription.abandon)
    for future in list(waiting):
        future.cancel()


def token_counts(subscription: Subscription) -> dict[str, int]:
    """Replicate's LLM metrics: the prompt's tokens as the engine got them (chat template
    applied) and the tokens generated, from the generation's own usage."""
    usage = subscription.usage
    return {"input_token_count": usage.prompt_tokens, "output_token_count": usage.completion_tokens}


def record_token_counts(subscription: Subscription, record: Callable[[str, int], None]) -> None:
    # Read from the slot thread: two ints the loop no longer changes once the text has ended.
    try:
        for key, value in token_counts(subscription).items():
            record(key, value)
    except Exception:  # a metric must never turn a delivered answer into a failure
        log.exception("recording the token counts failed")


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


def _check_engine_alive(service: Service) -> None:
    """Refuse a prediction that arrives after the engine died: it never started, and saying
    "died during generation" would blame a generation that never ran."""
    if not service.healthy():
        raise EngineUnavailable(
            "the engine had already died before this prediction started; this instance cannot "
            "serve (its health check says UNHEALTHY) and must be replaced"
        )


def engine_metrics(service: Service) -> dict[str, int]:
    """Engine-side figures a prediction reports in its `metrics` (read before it is admitted).

    `engine_running_requests` is vLLM's own count of unfinished requests: the ground truth a
    caller (or a test) can use to see that a cancelled prediction left nothing running. After
    the engine died it is 0 (`Engine.running_requests`): nothing runs any more.
    """
    return {"engine_running_requests": service.running_requests()}
