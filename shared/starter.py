"""How a new generation starts on this replica: its prompt rendered and checked, its output
registered, the engine's deltas produced into it, and its recipe logged for a takeover.

A short prompt is rendered and checked at once (cheaper than any hop, and a 4xx reaches the
caller before anything runs); a long one inside the generation's task, in the one tokenizer
thread, and readers wait for that verdict (`Subscription.admitted`) before any 200 is sent.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace

from shared.engine.contract import SamplingRequest
from shared.errors import BundleError, Cancelled, GenerationFailed
from shared.generation.engine_side import EngineSide
from shared.generation.output import GenerationOutput, produce
from shared.generation.registry import Entry, Registry
from shared.generation.replay import ReplayBuffer
from shared.obs import request_traces
from shared.replicas import takeover
from shared.replicas.identity import Identity
from shared.sampling import (
    OpenAIRequest,
    check_prompt_size,
    output_choices,
    prompt_chars,
    prompt_ids,
    sampling_request,
)
from shared.streaming import ChunkEncoder, Kind

log = logging.getLogger(__name__)

# Prompts up to this many characters are tokenized on the event loop (well under a millisecond);
# longer ones in the tokenizer thread, so one huge prompt never stalls the other streams.
INLINE_TOKENIZE_MAX_CHARS = 4096
Prepared = tuple[list[int], SamplingRequest]


class Starter:
    def __init__(self, side: EngineSide, registry: Registry) -> None:
        self._side = side
        self._registry = registry

    def start(
        self,
        identity: Identity,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None,
        fingerprint: str | None,
        *,
        numbered: bool,
    ) -> Entry:
        """Register and start a generation (mirrored and owned through `identity` when it has
        an id, so that other replicas can follow it). Raises its 4xx or 429 before it starts."""
        chars = prompt_chars(body)
        check_prompt_size(body, chars, self._side.settings)
        trace = request_traces.generation_trace()  # None unless this request is traced
        trace_headers = trace.engine_headers() if trace is not None else None
        prepared = None
        if chars <= INLINE_TOKENIZE_MAX_CHARS:
            ids = prompt_ids(body, self._side.engine, self._side.settings)
            prepared = (ids, self._sampling(body, ids, trace_headers))
        completion_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        output = GenerationOutput(
            encoder=ChunkEncoder(kind, completion_id, body.model),  # the base's name or an adapter's
            events=ReplayBuffer(self._side.settings.max_events_per_request, numbered=numbered),
            stream=body.stream,
            include_usage=body.include_usage,
            choices=output_choices(kind, body, self._side.engine),
        )
        output.trace = trace

        async def producer(out: GenerationOutput, abort_reason: Callable[[], str]) -> None:
            await self._prepare_and_produce(identity, entry, kind, body, abort_reason, prepared, trace_headers)

        if prepared is not None:
            output.accept(prompt_tokens=len(prepared[0]))
        entry = Entry(request_id=request_id, fingerprint=fingerprint, output=output)
        if request_id is not None:  # others may follow it: what they read goes behind it first
            identity.mirror(entry)
        self._registry.start(entry, producer)
        if request_id is not None:
            identity.own(entry)
        return entry

    def _sampling(
        self, body: OpenAIRequest, ids: list[int], trace_headers: Mapping[str, str] | None
    ) -> SamplingRequest:
        adapter = self._side.adapters.resolve(body.model)
        interval = self._side.pacing.engine_interval()
        sampling = sampling_request(
            body, ids, self._side.engine, self._side.settings, adapter=adapter, stream_interval=interval
        )
        return sampling if trace_headers is None else replace(sampling, trace_headers=trace_headers)

    async def _prepare_and_produce(
        self,
        identity: Identity,
        entry: Entry,
        kind: Kind,
        body: OpenAIRequest,
        abort_reason: Callable[[], str],
        prepared: Prepared | None,
        trace_headers: Mapping[str, str] | None,
    ) -> None:
        output = entry.output
        if prepared is None:
            prepared = await self._prepare(output, body, abort_reason, trace_headers)
            if prepared is None:
                return
            output.accept(prompt_tokens=len(prepared[0]))
        sampling = prepared[1]
        if entry.request_id is not None:
            identity.record(entry, lambda: _recipe(output, kind, body, sampling))
        await self._produce(output, sampling, abort_reason)

    async def _prepare(
        self,
        output: GenerationOutput,
        body: OpenAIRequest,
        abort_reason: Callable[[], str],
        trace_headers: Mapping[str, str] | None,
    ) -> Prepared | None:
        """A long prompt, rendered and checked off the event loop; None once its readers got
        the refusal instead."""
        try:
            ids = await self._render_in_thread(body)
            return ids, self._sampling(body, ids, trace_headers)
        except BundleError as exc:
            output.reject(exc)  # a 4xx for every reader; the engine never saw it
        except asyncio.CancelledError:  # aborted while rendering (its only reader left)
            output.reject(Cancelled(f"generation aborted: {abort_reason()}"))
        except Exception as exc:  # a tokenizer failure must not leave readers waiting
            log.exception("rendering the prompt failed")
            output.reject(GenerationFailed(f"rendering the prompt failed: {type(exc).__name__}"))
        return None

    async def _produce(
        self, output: GenerationOutput, sampling: SamplingRequest, abort_reason: Callable[[], str]
    ) -> None:
        completion_id = output.encoder.completion_id
        try:
            await produce(
                output,
                self._side.engine.generate(completion_id, sampling),
                self._side.metrics,
                self._side.settings.request_timeout_s,
                abort_reason,
            )
        finally:  # per model, counted once per generation: nothing on the per-token path
            adapter = sampling.adapter
            if adapter is None or self._side.adapters.holds(adapter):  # an unloaded one's series are gone
                model = adapter.name if adapter else self._side.settings.model_name
                self._side.metrics.count_model(
                    model, output.usage.prompt_tokens, output.usage.completion_tokens
                )

    async def _render_in_thread(self, body: OpenAIRequest) -> list[int]:
        """Tokenize (or apply the chat template) in the one tokenizer thread (one, because a
        Hugging Face tokenizer is not safe to call from two threads at once)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._side.tokenizer_thread, prompt_ids, body, self._side.engine, self._side.settings
        )


def _recipe(
    output: GenerationOutput, kind: Kind, body: OpenAIRequest, sampling: SamplingRequest
) -> takeover.Recipe:
    """What another replica needs to take the generation over (built only where one can)."""
    return takeover.Recipe(
        kind=kind,
        completion_id=output.encoder.completion_id,
        created=output.encoder.created,
        model=body.model,
        stream=output.stream,
        include_usage=output.include_usage,
        prompt=list(sampling.prompt_token_ids),
        sampling=takeover.sampling_of(sampling),
        refusal=takeover.refusal_of(sampling, shaped=output.choices is not None),
    )
