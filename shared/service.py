"""The one door of the core, free of HTTP: open a generation, cancel one by id, health.

`api.py` translates HTTP to these calls and the Cog bridge translates Cog's; neither touches the
registry or a generation's lifecycle. `open` validates, looks up the identity, admits (or
attaches, or resumes) and returns a `Subscription` to follow.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from shared.engine import Engine, SamplingRequest
from shared.errors import EventsGone, InvalidRequest, ModelNotFound, NotFound
from shared.generation import GenerationOutput, produce
from shared.metrics import Metrics
from shared.protocol import ChatCompletionRequest, CompletionRequest
from shared.registry import CancelOutcome, Entry, Registry, Subscription
from shared.replay import ReplayBuffer
from shared.settings import Settings
from shared.stats_file import publish_engine_stats
from shared.streaming import ChunkEncoder, Kind

if TYPE_CHECKING:
    from shared.replicas import Opened, Replicas

__all__ = ["CancelOutcome", "Service", "Subscription"]
log = logging.getLogger(__name__)

OpenAIRequest = ChatCompletionRequest | CompletionRequest
CANCEL_WAIT_S = 5.0  # how long a cancel call waits for the generation to stop before answering


class Service:
    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.metrics.watch_engine(engine.running_requests)
        self.registry = Registry(settings, self.metrics)
        self.replicas = _shared_identity(settings, self.registry, self.metrics)
        self._stats_task: asyncio.Task[None] | None = None
        if settings.engine_stats_file is not None:
            publisher = publish_engine_stats(
                engine, settings.engine_stats_file, settings.engine_stats_interval_s
            )
            self._stats_task = asyncio.get_running_loop().create_task(publisher)

    async def aclose(self) -> None:
        """Abort what is still running and stop background work."""
        await self.registry.shutdown()
        if self.replicas is not None:
            await self.replicas.aclose()
        if self._stats_task is not None:
            self._stats_task.cancel()

    # --- the door -------------------------------------------------------------------------------
    def open(
        self,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None = None,
        last_event_id: int | None = None,
    ) -> Subscription:
        """Subscribe to the generation this request names: an existing one (same id and body:
        attach, resume after `last_event_id`, or replay) or a new one, validated and started.

        Runs without awaiting on purpose: between the lookup and the start nothing else can
        run, so two simultaneous requests with one id can never start two generations.
        A resume (`last_event_id` given) never starts one: a fresh generation under the old
        event ids would splice two different texts together.
        """
        if last_event_id is not None and request_id is None:
            raise InvalidRequest("Last-Event-ID needs the X-Request-Id of the stream to resume")
        entry = self._existing_or_new(kind, body, request_id, resume=last_event_id is not None)
        after = last_event_id or 0
        if entry.output.stream:
            entry.output.events.check_resumable(after)
        return self.registry.subscribe(entry, after)

    async def open_shared(
        self,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None = None,
        last_event_id: int | None = None,
    ) -> Subscription | Opened:
        """`open` across replicas: with a shared store (BUNDLE_REDIS_URL), a request with an id
        that another replica claimed follows that replica's generation (shared/replicas.py).
        Without a store, or without an id, it is `open`."""
        if self.replicas is None or request_id is None:
            return self.open(kind, body, request_id, last_event_id)
        self._check_model(body.model)
        return await self.replicas.open(
            request_id,
            _fingerprint(kind, body),
            body.stream,
            last_event_id,
            here=lambda: self.open(kind, body, request_id, last_event_id),
        )

    async def cancel(self, request_id: str) -> CancelOutcome:
        """Abort the generation this id names; attached streams end with an error event."""
        try:
            return await self.registry.cancel(request_id, wait_s=CANCEL_WAIT_S)
        except NotFound:
            if self.replicas is None:
                raise
            return await self.replicas.cancel(request_id, CANCEL_WAIT_S)  # owned by another replica

    def healthy(self) -> bool:
        return self.engine.healthy()

    def stats(self) -> dict[str, int]:
        """Held requests, running generations, held events and readers (for leak checks)."""
        return self.registry.stats()

    def model_card(self) -> dict[str, object]:
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm-serverless-bundle",
            "max_model_len": self.engine.info.max_model_len,
        }

    # --- admission ------------------------------------------------------------------------------
    def _existing_or_new(
        self, kind: Kind, body: OpenAIRequest, request_id: str | None, *, resume: bool
    ) -> Entry:
        self._check_model(body.model)
        fingerprint = None
        if request_id is not None:
            # Only a named request can be matched again, so only a named one pays for this.
            fingerprint = _fingerprint(kind, body)
            existing = self.registry.find(request_id, fingerprint)
            if existing is not None:
                self.metrics.replayed_requests.inc()
                return existing
        if resume:
            raise EventsGone(
                f"no stream with X-Request-Id {request_id!r} is held any more; "
                "start a new request with a new id"
            )
        return self._start(kind, body, request_id, fingerprint)

    def _start(self, kind: Kind, body: OpenAIRequest, request_id: str | None, fingerprint: str | None) -> Entry:
        prompt_ids = self._prompt_ids(body)
        sampling = self._sampling(body, prompt_ids)
        completion_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        output = GenerationOutput(
            encoder=ChunkEncoder(kind, completion_id, self.settings.model_name),
            events=ReplayBuffer(self.settings.max_events_per_request),
            stream=body.stream,
            include_usage=body.include_usage,
            prompt_tokens=len(prompt_ids),
        )

        async def producer(out: GenerationOutput, abort_reason: Callable[[], str]) -> None:
            await produce(
                out,
                self.engine,
                sampling,
                self.metrics,
                self.settings.request_timeout_s,
                engine_request_id=completion_id,
                abort_reason=abort_reason,
            )

        entry = Entry(request_id=request_id, fingerprint=fingerprint, output=output)
        self.registry.start(entry, producer)
        if self.replicas is not None and request_id is not None:
            self.replicas.own(entry)
        return entry

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise ModelNotFound(
                f"model {model!r} is not served here; this server serves {self.settings.model_name!r}",
                param="model",
            )

    def _prompt_ids(self, body: OpenAIRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            ids = self.engine.render_chat(body.message_dicts())
        elif isinstance(body.prompt, list):
            ids = self._checked_token_ids(body.prompt)
        else:
            ids = self.engine.tokenize(body.prompt)
        if len(ids) > self.settings.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens; the limit is {self.settings.max_prompt_tokens}",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        return ids

    def _checked_token_ids(self, ids: list[int]) -> list[int]:
        vocabulary = self.engine.info.vocab_size
        if vocabulary and max(ids) >= vocabulary:
            raise InvalidRequest(
                f"prompt token id {max(ids)} is outside the vocabulary of {vocabulary}",
                param="prompt",
            )
        return ids

    def _sampling(self, body: OpenAIRequest, prompt_ids: list[int]) -> SamplingRequest:
        limit = self.settings.max_tokens_limit
        max_tokens = body.requested_max_tokens
        if max_tokens is not None and max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens {max_tokens} exceeds this server's limit of {limit}",
                param="max_tokens",
            )
        room = self.engine.info.max_model_len - len(prompt_ids)
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, room)
        if max_tokens > room or room <= 0:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {self.engine.info.max_model_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return SamplingRequest(
            prompt_token_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            stop=body.stop_list,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            ignore_eos=body.ignore_eos,
        )


def _shared_identity(settings: Settings, registry: Registry, metrics: Metrics) -> Replicas | None:
    if settings.redis_url is None:
        log.info(
            "request identity: this process only (BUNDLE_REDIS_URL is not set); a retry or resume "
            "that reaches another replica is not matched"
        )
        return None
    from shared.replicas import Replicas  # redis is imported only when a store is configured

    return Replicas(settings, registry, metrics)


def _fingerprint(kind: Kind, body: OpenAIRequest) -> str:
    """Identity of a request body, independent of key order and whitespace."""
    canonical = orjson.dumps(
        {"kind": kind, "body": body.model_dump(mode="json", exclude_unset=True)},
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(canonical).hexdigest()
