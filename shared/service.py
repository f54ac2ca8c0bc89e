"""The one door of the core, free of HTTP: open a generation, cancel one by id, health.

`api.py` translates HTTP to these calls and the Cog bridge translates Cog's; neither touches the
registry or a generation's lifecycle. `open` validates, looks up the identity, admits (or
attaches, or resumes) and returns a `Subscription` to follow.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Callable

import orjson

from shared.choices import Choices
from shared.engine import Engine, SamplingRequest
from shared.errors import EventsGone, InvalidRequest, ModelNotFound
from shared.generation import GenerationOutput, produce
from shared.metrics import Metrics
from shared.protocol import ChatCompletionRequest, CompletionRequest
from shared.registry import CancelOutcome, Entry, Registry, Subscription
from shared.replay import ReplayBuffer
from shared.settings import Settings
from shared.stats_file import publish_engine_stats
from shared.streaming import ChunkEncoder, Kind
from shared.structured import OutputConstraint, response_constraint
from shared.tools import check_tool_schemas, forced_constraint, shaper_for

__all__ = ["CancelOutcome", "Service", "Subscription"]

OpenAIRequest = ChatCompletionRequest | CompletionRequest
CANCEL_WAIT_S = 5.0  # how long a cancel call waits for the generation to stop before answering


class Service:
    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.metrics.watch_engine(engine.running_requests)
        self.registry = Registry(settings, self.metrics)
        self._stats_task: asyncio.Task[None] | None = None
        if settings.engine_stats_file is not None:
            publisher = publish_engine_stats(
                engine, settings.engine_stats_file, settings.engine_stats_interval_s
            )
            self._stats_task = asyncio.get_running_loop().create_task(publisher)

    async def aclose(self) -> None:
        """Abort what is still running and stop background work."""
        await self.registry.shutdown()
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

    async def cancel(self, request_id: str) -> CancelOutcome:
        """Abort the generation this id names; attached streams end with an error event."""
        return await self.registry.cancel(request_id, wait_s=CANCEL_WAIT_S)

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
            choices=self._choices(kind, body),
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
        return entry

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise ModelNotFound(
                f"model {model!r} is not served here; this server serves {self.settings.model_name!r}",
                param="model",
            )

    def _prompt_ids(self, body: OpenAIRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            ids = self.engine.render_chat(body.message_dicts(), body.tool_dicts())
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

    def _checked_token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocabulary = self.engine.info.vocab_size
        if ids and vocabulary and max(ids) >= vocabulary:
            raise InvalidRequest(
                f"{param} token id {max(ids)} is outside the vocabulary of {vocabulary}",
                param=param,
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
        if body.n > self.settings.max_n:
            raise InvalidRequest(f"n {body.n} exceeds this server's limit of {self.settings.max_n}", param="n")
        logit_bias = body.logit_bias_ids
        self._checked_token_ids(list(logit_bias), "logit_bias")
        self._checked_token_ids(body.stop_token_ids or [], "stop_token_ids")
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
            n=body.n,
            logprobs=body.top_logprobs_count,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias,
            constraint=_constraint(body),
        )

    def _choices(self, kind: Kind, body: OpenAIRequest) -> Choices | None:
        """The slow output path, only for requests that need it (see shared/choices.py)."""
        with_logprobs = body.top_logprobs_count is not None
        tools = isinstance(body, ChatCompletionRequest) and body.uses_tools
        if body.n == 1 and not with_logprobs and not tools:
            return None
        if not tools:
            return Choices(kind, body.n, with_logprobs=with_logprobs)
        engine = self.engine
        return Choices(
            kind, body.n, with_logprobs=with_logprobs, shaper_factory=lambda: shaper_for(body, engine)
        )


def _constraint(body: OpenAIRequest) -> OutputConstraint | None:
    """What the output is constrained to: a forced tool call's JSON, or response_format's."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    if body.uses_tools:
        check_tool_schemas(body.tools or [])
        if body.forced_tool_call:
            return forced_constraint(body.tools or [], body.tool_choice, body.parallel_tool_calls)
    return response_constraint(body.response_format)


def _fingerprint(kind: Kind, body: OpenAIRequest) -> str:
    """Identity of a request body, independent of key order and whitespace. Every field the
    request schema knows is covered (tools, response_format, n, logprobs...); an explicit null
    never reaches here (the schema drops it), so it is the same request as the field left out."""
    canonical = orjson.dumps(
        {"kind": kind, "body": body.model_dump(mode="json", exclude_unset=True, by_alias=True)},
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(canonical).hexdigest()
