"""The one door of the core, free of HTTP: open a generation, cancel one by id, health, stats.

`api.py` translates HTTP to these calls and the Cog bridge translates Cog's; neither touches the
registry, the identity store, the engine or the metrics objects. `open` validates, looks up the
identity (this process's, or the replicas' through BUNDLE_REDIS_URL: shared/replicas/identity.py), admits
(or attaches, or resumes) and returns a `Subscription` to follow. `shared.assembly.start_service`
is the one way a running service is put together.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

import orjson

from shared.engine.contract import Engine, EngineDelta, OutputConstraint, SamplingRequest
from shared.engine.lora import Adapters
from shared.engine.stats_file import publish_engine_stats
from shared.errors import (
    BundleError,
    Cancelled,
    EventsGone,
    GenerationFailed,
    InvalidRequest,
    NotFound,
    ProducerLost,
)
from shared.generation.output import GenerationOutput, produce
from shared.generation.registry import CancelOutcome, Entry, Registry
from shared.generation.replay import ReplayBuffer
from shared.generation.subscription import Subscription
from shared.obs.gc_pauses import gc_pauses_observed
from shared.obs.loop_lag import watch_loop_lag
from shared.obs.metrics import Metrics
from shared.obs.slow_exit import report_if_slow
from shared.replicas import takeover
from shared.replicas.identity import Identity, LocalIdentity
from shared.replicas.store import Claim
from shared.schemas import ChatCompletionRequest, CompletionRequest
from shared.settings import Settings
from shared.shaping.choices import Choices
from shared.shaping.structured import response_constraint
from shared.shaping.tools import check_tool_schemas, forced_constraint, shaper_for
from shared.streaming import ChunkEncoder, Kind

__all__ = ["CancelOutcome", "Service", "Subscription"]

log = logging.getLogger(__name__)
# A shutdown still running this long is stuck somewhere: its pending tasks are logged (once).
SLOW_SHUTDOWN_S = 15.0

OpenAIRequest = ChatCompletionRequest | CompletionRequest
# Tokens per event under stream load (`stream_batch_at`): on the H200 vLLM's stream interval 2
# kept the bundle's TTFT at 256 streams within 1 % of raw's, where 1 was 29 % above it.
PAIRED = 2
CANCEL_WAIT_S = 5.0  # how long a cancel call waits for the generation to stop before answering
# Prompts up to this many characters are tokenized on the event loop (well under a millisecond);
# longer ones in the tokenizer thread, so one huge prompt never stalls the other streams.
INLINE_TOKENIZE_MAX_CHARS = 4096
MAX_CHARS_PER_TOKEN = 32  # ordinary text averages ~4 characters per token
LOST_AND_NOT_CONTINUED = "the replica running this generation stopped, and it cannot be continued"
NEW_ID = "start again with a new X-Request-Id"


class Service:
    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.metrics.watch_engine(engine.running_requests)
        timings = engine.output_timings  # vLLM's engine only (shared/obs/engine_outputs.py)
        if timings is not None:
            self.metrics.watch_engine_outputs(timings)
        features = engine.features  # vLLM's engine only (shared/engine/vllm_features.py)
        if features is not None:
            self.metrics.show_engine_features((feature.name, feature.path) for feature in features.found)
        self.registry = Registry(settings, self.metrics)
        # Start-time adapters were loaded with the engine (shared/engine/vllm_startup.py, `open_engine`).
        self.adapters = Adapters(settings, engine, self.metrics, engine.static_adapters)
        self.metrics.watch_held(lambda: self.registry.stats()["held_requests"])
        self._identity: Identity = identity_for(settings, self.registry, self.metrics)
        self._identity.continue_with(self.continue_generation)
        self._stats_task: asyncio.Task[None] | None = None
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-tokenizer")
        if settings.engine_stats_file is not None:
            publisher = publish_engine_stats(
                engine, settings.engine_stats_file, settings.engine_stats_interval_s
            )
            self._stats_task = asyncio.get_running_loop().create_task(publisher)

    async def end_running(self) -> None:
        """The drain's deadline: hand what another replica can continue over to one (with a
        shared store and takeover: its readers resume there), abort the rest now (reason
        "shutdown"; their readers get an error event)."""
        await self._identity.hand_off()
        await self.registry.shutdown()

    async def aclose(self) -> None:
        """Hand over or abort what is still running, and stop background work."""
        with report_if_slow("the service's shutdown", SLOW_SHUTDOWN_S):
            await self._identity.hand_off()
            await self.registry.shutdown()
            await self._identity.aclose()
        if self._stats_task is not None:
            self._stats_task.cancel()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # --- the door -------------------------------------------------------------------------------
    async def open(
        self,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None = None,
        last_event_id: int | None = None,
        *,
        event_ids: bool = False,
    ) -> Subscription:
        """Subscribe to the generation this request names: an existing one (same id and body:
        attach, resume after `last_event_id`, or replay), here or on another replica sharing the
        store, or a new one, validated and started.

        `event_ids`: the client asked for SSE proper (Accept: text/event-stream). Only the request
        that starts a generation decides; readers that attach later get the same bytes.
        """
        if request_id is None:
            return self._open_here(kind, body, request_id, last_event_id, event_ids=event_ids)
        self._check_model(body.model)  # before any claim in a shared store
        return await self._identity.open(
            request_id,
            _fingerprint(kind, body),
            body.stream,
            last_event_id,
            here=lambda: self._open_here(kind, body, request_id, last_event_id, event_ids=event_ids),
            numbered=event_ids,
        )

    def _open_here(
        self,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None,
        last_event_id: int | None,
        *,
        event_ids: bool,
    ) -> Subscription:
        """`open` on this replica's registry. Runs without awaiting on purpose: between the
        lookup and the start nothing else can run, so two simultaneous requests with one id can
        never start two generations. A resume (`last_event_id` given) never starts one: a fresh
        generation under the old event ids would splice two different texts together."""
        if last_event_id is not None and request_id is None:
            raise InvalidRequest("Last-Event-ID needs the X-Request-Id of the stream to resume")
        resume = last_event_id is not None
        entry, attached = self._existing_or_new(kind, body, request_id, resume=resume, event_ids=event_ids)
        after = last_event_id or 0
        if entry.output.stream:
            entry.output.events.check_resumable(after)
        if attached:  # counted once the resume point is known to be good
            self.metrics.replayed_requests.inc()
        return self.registry.subscribe(entry, after)

    async def cancel(self, request_id: str) -> CancelOutcome:
        """Abort the generation this id names; attached streams end with an error event."""
        try:
            return await self.registry.cancel(request_id, wait_s=CANCEL_WAIT_S)
        except NotFound:  # another replica's, if a store is shared; else NotFound again
            return await self._identity.cancel(request_id, CANCEL_WAIT_S)

    @property
    def pairs_writes(self) -> bool:
        """Whether streams are paced by their writes (`events_per_write`): with
        `stream_batch_at` set, on an engine that cannot pace each request itself."""
        return self.settings.stream_batch_at is not None and not self.engine.paces_each_request

    def events_per_write(self) -> int:
        """New events a caught-up stream waits for before its next write: 2 while at least
        `stream_batch_at` generations run on this replica, else 1."""
        return PAIRED if self._under_stream_load() else 1

    def _paced_interval(self) -> int | None:
        """A new generation's tokens per output after the first: 2 from vLLM itself when at
        least `stream_batch_at` generations already run here and the engine paces each request
        (half of vLLM's own per-token output work goes too, not only the writes); None, the
        engine's own interval, otherwise. Counted by generations admitted, not by streams being
        written: in a burst every request is admitted before the first stream is written."""
        if self.engine.paces_each_request and self._under_stream_load():
            return PAIRED
        return None

    def _under_stream_load(self) -> bool:
        batch_at = self.settings.stream_batch_at
        return batch_at is not None and self.registry.running >= batch_at

    def runs_here(self, request_id: str) -> bool:
        """Whether this replica runs the generation of `request_id` now."""
        return self.registry.runs(request_id)

    async def orphans(self, request_ids: list[str]) -> list[str]:
        """Those ids whose generation runs with nobody left to run it: opening one takes it over
        (with a shared store and takeover; none otherwise)."""
        return await self._identity.orphans(request_ids)

    def healthy(self) -> bool:
        """The engine is alive (false once it died: the process should be replaced)."""
        return self.engine.healthy()

    def ready(self) -> bool:
        """Alive and awake: what a load balancer's health check should see (503 while asleep)."""
        return self.engine.ready()

    def stats(self) -> dict[str, int]:
        """Held requests, running generations, held events and readers (for leak checks)."""
        return self.registry.stats()

    def running_requests(self) -> int:
        """Requests the engine itself holds (0 once it died): vLLM's own count, the ground truth
        that a cancelled generation left nothing running."""
        return self.engine.running_requests()

    def streams_being_read(self) -> int:
        """Readers of SSE streams right now, on this replica's generations or others'."""
        return self.metrics.streams_read

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of this service's metrics."""
        return self.metrics.exposition()

    def record_admission(self, seconds: float) -> None:
        """How long a request took from its first byte to being admitted (or joined)."""
        self.metrics.admission.observe(seconds)

    def count_rejection(self, status: int) -> None:
        """A request refused before it reached the engine, by its HTTP status."""
        self.metrics.rejected_requests.labels(str(status)).inc()

    def count_direct_write_fallback(self, reason: str) -> None:
        """A stream chunk that went through the server's send instead of a direct write, and why."""
        self.metrics.direct_write_fallbacks.labels(reason).inc()

    async def watch_loop_lag(self) -> None:
        """Until cancelled: how late this event loop runs (shared/obs/loop_lag.py)."""
        await watch_loop_lag(self.metrics.event_loop_lag)

    def gc_pauses_observed(self) -> AbstractContextManager[None]:
        """While the block runs, every garbage collection's pause (shared/obs/gc_pauses.py)."""
        return gc_pauses_observed(self.metrics.gc_pause)

    def model_card(self) -> dict[str, object]:
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "vllm-serverless-bundle",
            "max_model_len": self.engine.info.max_model_len,
        }

    def model_cards(self) -> list[dict[str, object]]:
        """The base model, then every loaded LoRA adapter with the base as its `parent` (as
        vLLM's server lists them; `root` is where the adapter came from), the base model the
        adapter names and any warning about it (shared/engine/lora.py)."""
        base = self.model_card()
        cards: list[dict[str, object]] = [{**base, "root": self.settings.model, "parent": None}]
        for adapter in self.adapters.loaded():
            card = {**base, "id": adapter.name, "root": adapter.source, "parent": base["id"]}
            cards.append({**card, **adapter.card_fields()})
        return cards

    # --- admission ------------------------------------------------------------------------------
    def _existing_or_new(
        self, kind: Kind, body: OpenAIRequest, request_id: str | None, *, resume: bool, event_ids: bool
    ) -> tuple[Entry, bool]:
        """The generation to read, and whether it already existed (an attach, resume or replay)."""
        self._check_model(body.model)
        fingerprint = None
        if request_id is not None:
            # Only a named request can be matched again, so only a named one pays for this.
            fingerprint = _fingerprint(kind, body)
            existing = self.registry.find(request_id, fingerprint)
            if existing is not None:
                return existing, True
        if resume:
            raise EventsGone(
                f"no stream with X-Request-Id {request_id!r} is held any more; "
                "start a new request with a new id"
            )
        # Numbered only when the client can come back (an id) and reads SSE proper (asked for
        # text/event-stream): OpenAI's own clients and vLLM's bench read one `data:` line per event.
        numbered = request_id is not None and event_ids
        return self._start(kind, body, request_id, fingerprint, numbered=numbered), False

    def _start(
        self,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None,
        fingerprint: str | None,
        *,
        numbered: bool,
    ) -> Entry:
        """Register and start a generation. A short prompt is rendered and checked right here
        (cheaper than any hop, and a 4xx is raised to the caller at once); a long one inside the
        generation's task, off the event loop (`_prepare_and_produce`), and readers wait for
        that verdict (`Subscription.admitted`) before any 200 is sent."""
        chars = _prompt_chars(body)
        self._check_prompt_size(body, chars)
        prepared = None
        if chars <= INLINE_TOKENIZE_MAX_CHARS:
            prompt_ids = self._prompt_ids(body)
            prepared = (prompt_ids, self._sampling(body, prompt_ids))
        completion_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        output = GenerationOutput(
            encoder=ChunkEncoder(kind, completion_id, body.model),  # the base's name or an adapter's
            events=ReplayBuffer(self.settings.max_events_per_request, numbered=numbered),
            stream=body.stream,
            include_usage=body.include_usage,
            choices=self._choices(kind, body),
        )

        async def producer(out: GenerationOutput, abort_reason: Callable[[], str]) -> None:
            await self._prepare_and_produce(entry, kind, body, abort_reason, prepared)

        if prepared is not None:
            output.accept(prompt_tokens=len(prepared[0]))
        entry = Entry(request_id=request_id, fingerprint=fingerprint, output=output)
        if request_id is not None:  # others may follow it: what they read goes behind it first
            self._identity.mirror(entry)
        self.registry.start(entry, producer)
        if request_id is not None:
            self._identity.own(entry)
        return entry

    async def _prepare_and_produce(
        self,
        entry: Entry,
        kind: Kind,
        body: OpenAIRequest,
        abort_reason: Callable[[], str],
        prepared: tuple[list[int], SamplingRequest] | None,
    ) -> None:
        output = entry.output
        completion_id = output.encoder.completion_id
        if prepared is not None:
            self._record(entry, kind, body, prepared[1])
            await self._produce(output, prepared[1], completion_id, abort_reason)
            return
        try:
            prompt_ids = await self._render_in_thread(body)
            sampling = self._sampling(body, prompt_ids)
        except BundleError as exc:
            output.reject(exc)  # a 4xx for every reader; the engine never saw it
            return
        except asyncio.CancelledError:  # aborted while rendering (its only reader left)
            output.reject(Cancelled(f"generation aborted: {abort_reason()}"))
            return
        except Exception as exc:  # a tokenizer failure must not leave readers waiting
            log.exception("rendering the prompt failed")
            output.reject(GenerationFailed(f"rendering the prompt failed: {type(exc).__name__}"))
            return
        output.accept(prompt_tokens=len(prompt_ids))
        self._record(entry, kind, body, sampling)
        await self._produce(output, sampling, completion_id, abort_reason)

    def _record(self, entry: Entry, kind: Kind, body: OpenAIRequest, sampling: SamplingRequest) -> None:
        """Before the engine sees it: what another replica needs to take it over."""
        if entry.request_id is None:
            return
        output = entry.output

        def recipe() -> takeover.Recipe:
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

        self._identity.record(entry, recipe)

    async def _produce(
        self,
        output: GenerationOutput,
        sampling: SamplingRequest,
        completion_id: str,
        abort_reason: Callable[[], str],
    ) -> None:
        try:
            await produce(
                output,
                self.engine.generate(completion_id, sampling),
                self.metrics,
                self.settings.request_timeout_s,
                abort_reason,
            )
        finally:  # per model, counted once per generation: nothing on the per-token path
            adapter = sampling.adapter
            if adapter is None or self.adapters.holds(adapter):  # an unloaded one's series are gone
                model = adapter.name if adapter else self.settings.model_name
                self.metrics.count_model(model, output.usage.prompt_tokens, output.usage.completion_tokens)

    # --- takeover: continue a generation another replica started ---------------------------------
    async def continue_generation(
        self, request_id: str, claim: Claim, logged: takeover.Logged, lost_at: float
    ) -> Entry:
        """Run here, under `claim` (this replica's now), the rest of a generation whose producer
        was lost: its log's events first (held for resumes), then what the engine adds after the
        token ids already sent (shared/replicas/takeover.py). One that cannot be continued
        exactly ends with `producer_lost` instead. Raises Overloaded (429) at the in-flight cap."""
        recipe = logged.recipe
        steps = None
        if recipe is not None and logged.finish_reason is None:
            steps = await self._decode_steps(recipe, logged.ids)
        plan = takeover.plan(logged, steps)
        output = _continued_output(recipe, logged, plan, claim, self.settings.max_events_per_request)
        entry = Entry(request_id=request_id, fingerprint=claim.fingerprint, output=output)

        async def producer(out: GenerationOutput, abort_reason: Callable[[], str]) -> None:
            await self._go_on(request_id, out, logged, plan, lost_at, abort_reason)

        self._identity.mirror(entry, kept=None if plan.refusal else plan.kept)
        self.registry.start(entry, producer)
        self._identity.own(entry)
        outcome = "ended" if plan.refusal else "continued"
        self.metrics.takeovers.labels(outcome).inc()
        log.info("took over %s (%s): %s", request_id, outcome, plan.refusal or f"{plan.kept} tokens kept")
        return entry

    async def _decode_steps(self, recipe: takeover.Recipe, ids: list[int]) -> Sequence[str | None] | None:
        decode = getattr(self.engine, "decode_steps", None)  # vLLM's engine only
        if decode is None:
            return None
        skip_special = bool(recipe.sampling["skip_special_tokens"])
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, decode, recipe.prompt, ids, skip_special)  # type: ignore[no-any-return]

    async def _go_on(
        self,
        request_id: str,
        output: GenerationOutput,
        logged: takeover.Logged,
        plan: takeover.Plan,
        lost_at: float,
        abort_reason: Callable[[], str],
    ) -> None:
        """The producer of a continuation: nothing left but its end, or the engine's rest."""
        if plan.refusal is not None:
            output.finish(ProducerLost(f"{LOST_AND_NOT_CONTINUED} exactly ({plan.refusal}); {NEW_ID}"))
            return
        if logged.finish_reason is not None or plan.remaining <= 0:
            if logged.finish_reason is None:  # every token was out, only the finish was not
                output.on_delta(EngineDelta(text="", token_count=0, finish_reason="length"))
            output.finish()
            return
        assert logged.recipe is not None
        try:
            sampling = self._continuation(request_id, logged, plan)
        except BundleError as exc:  # its adapter is not loaded here
            output.finish(ProducerLost(f"{LOST_AND_NOT_CONTINUED} here ({exc.message}); {NEW_ID}"))
            return
        deltas = takeover.after_sent(self.engine.generate(logged.recipe.completion_id, sampling), plan.resent)
        timeout = self.settings.request_timeout_s
        await produce(output, self._timed(deltas, lost_at), self.metrics, timeout, abort_reason, opening=False)

    def _continuation(self, request_id: str, logged: takeover.Logged, plan: takeover.Plan) -> SamplingRequest:
        recipe = logged.recipe
        assert recipe is not None
        given = recipe.sampling
        return SamplingRequest(
            prompt_token_ids=recipe.prompt + logged.ids[: plan.kept],
            max_tokens=plan.remaining,
            temperature=given["temperature"],
            top_p=given["top_p"],
            top_k=given["top_k"],
            seed=takeover.continuation_seed(recipe, request_id, plan.kept),
            stop=tuple(given["stop"]),
            presence_penalty=given["presence_penalty"],
            frequency_penalty=given["frequency_penalty"],
            ignore_eos=given["ignore_eos"],
            min_p=given["min_p"],
            repetition_penalty=given["repetition_penalty"],
            min_tokens=max(0, given["min_tokens"] - plan.kept),
            stop_token_ids=tuple(given["stop_token_ids"]),
            skip_special_tokens=given["skip_special_tokens"],
            include_stop_str_in_output=given["include_stop_str_in_output"],
            logit_bias={int(token): float(bias) for token, bias in given["logit_bias"]},
            stream_interval=self._paced_interval(),
            adapter=self.adapters.resolve(recipe.model),
        )

    async def _timed(self, deltas: AsyncIterator[EngineDelta], lost_at: float) -> AsyncIterator[EngineDelta]:
        """The deltas, counted as continued tokens; the first one times the takeover."""
        first = True
        async for delta in deltas:
            if first:
                self.metrics.takeover_seconds.observe(time.monotonic() - lost_at)
                first = False
            self.metrics.continued_tokens.inc(delta.token_count)
            yield delta

    async def _render_in_thread(self, body: OpenAIRequest) -> list[int]:
        """Tokenize (or apply the chat template) a long prompt without stalling other streams:
        in the one tokenizer thread (one, because a Hugging Face tokenizer is not safe to call
        from two threads at once)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, self._prompt_ids, body)

    def _check_prompt_size(self, body: OpenAIRequest, chars: int) -> None:
        """Refuse prompts that cannot fit before paying to tokenize them (a 1 MB prompt costs
        about a second of CPU): no tokenizer in use packs more than MAX_CHARS_PER_TOKEN
        characters into one token on ordinary text, so more characters than that many times
        the token limit can only be refused after tokenizing anyway."""
        limit = self.settings.max_prompt_tokens * MAX_CHARS_PER_TOKEN
        if chars > limit:
            raise InvalidRequest(
                f"prompt has {chars} characters; at most {limit} can fit the limit of "
                f"{self.settings.max_prompt_tokens} tokens",
                param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )

    def _check_model(self, model: str) -> None:
        self.adapters.resolve(model)  # 404 model_not_found unless the base or a loaded adapter

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
            constraint=_constraint(body, self.engine),
            stream_interval=self._paced_interval(),
            adapter=self.adapters.resolve(body.model),
        )

    def _choices(self, kind: Kind, body: OpenAIRequest) -> Choices | None:
        """The slow output path, only for requests that need it (see shared/shaping/choices.py)."""
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


def _continued_output(
    recipe: takeover.Recipe | None, logged: takeover.Logged, plan: takeover.Plan, claim: Claim, max_events: int
) -> GenerationOutput:
    """The output of a generation taken over: its chunks look like the first replica's (same id,
    creation time and model), its events so far are held for resumes, its text and usage go on
    from what was sent (usage counts the whole generation once)."""
    events = ReplayBuffer(max_events, numbered=claim.numbered)
    events.preload(logged.events)
    if recipe is None:  # nothing to continue with: it only ends (its error needs no encoder)
        output = GenerationOutput(
            encoder=ChunkEncoder("chat", "", ""), events=events, stream=claim.stream, include_usage=False
        )
        output.resume(0, logged.text, 0)
        return output
    encoder = ChunkEncoder(recipe.kind, recipe.completion_id, recipe.model, created=recipe.created)  # type: ignore[arg-type]
    output = GenerationOutput(
        encoder=encoder,
        events=events,
        stream=claim.stream,
        include_usage=recipe.include_usage and not logged.usage_sent,
    )
    kept = len(logged.ids) if logged.finish_reason is not None else plan.kept
    output.resume(len(recipe.prompt), logged.text, kept)
    output.finish_reason = logged.finish_reason
    return output


def _constraint(body: OpenAIRequest, engine: Engine) -> OutputConstraint | None:
    """What the output is constrained to (a forced tool call's JSON, or response_format's), once
    the engine has said it can enforce it."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    if body.uses_tools:
        check_tool_schemas(body.tools or [])
        if body.forced_tool_call:
            forced = forced_constraint(body.tools or [], body.tool_choice, body.parallel_tool_calls)
            engine.check_constraint(forced, "tools")
            return forced
    constraint = response_constraint(body.response_format)
    if constraint is not None:
        engine.check_constraint(constraint, "response_format")
    return constraint


def _fingerprint(kind: Kind, body: OpenAIRequest) -> str:
    """Identity of a request body, independent of key order and whitespace. Every field the
    request schema knows is covered (tools, response_format, n, logprobs...); an explicit null
    never reaches here (the schema drops it), so it is the same request as the field left out."""
    canonical = orjson.dumps(
        {"kind": kind, "body": body.model_dump(mode="json", exclude_unset=True, by_alias=True)},
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(canonical).hexdigest()


def _prompt_chars(body: OpenAIRequest) -> int:
    """Characters of text the prompt carries (token-id prompts count as none)."""
    if isinstance(body, ChatCompletionRequest):
        return sum(_content_chars(message.content) for message in body.messages)
    return len(body.prompt) if isinstance(body.prompt, str) else 0


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: count their text
        return sum(len(getattr(part, "text", None) or "") for part in content)
    return 0


def identity_for(settings: Settings, registry: Registry, metrics: Metrics) -> Identity:
    """The shared store when BUNDLE_REDIS_URL is set, else this process alone (logged, since a
    retry that reaches another replica is then not matched)."""
    if settings.redis_url is None:
        log.info(
            "request identity: this process only (BUNDLE_REDIS_URL is not set); a retry or resume "
            "that reaches another replica is not matched"
        )
        return LocalIdentity()
    from shared.replicas.replicated import Replicas  # redis is imported only when a store is configured

    return Replicas(settings, registry, metrics)
