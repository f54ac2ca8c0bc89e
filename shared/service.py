"""The one door of the core, free of HTTP: open a generation (attach, resume, start), cancel one
by id, health and stats. The wrappers (HTTP, Cog) translate to these calls and nothing else.

`open` validates, asks the request identity where the id's generation is read (this process's
registry, or the replicas' through BUNDLE_REDIS_URL: shared/replicas/identity.py), and returns a
`Subscription` to follow. `shared.assembly.start_service` is the one way a service is put together.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from shared.engine.contract import Engine
from shared.engine.lora import Adapters
from shared.engine.stats_file import publish_engine_stats
from shared.errors import EventsGone, InvalidRequest, NotFound
from shared.generation.engine_side import EngineSide
from shared.generation.pacing import StreamPacing
from shared.generation.registry import CancelOutcome, Entry, Registry
from shared.generation.subscription import Subscription
from shared.obs import request_traces
from shared.obs.metrics import Metrics
from shared.obs.otlp import Telemetry
from shared.obs.slow_exit import report_if_slow
from shared.replicas.continuation import Continuation
from shared.replicas.identity import Identity, LocalIdentity
from shared.sampling import OpenAIRequest
from shared.sampling import fingerprint as request_fingerprint
from shared.settings import Settings
from shared.starter import Starter
from shared.streaming import Kind

__all__ = ["CancelOutcome", "Service", "Subscription"]

log = logging.getLogger(__name__)
# A shutdown still running this long is stuck somewhere: its pending tasks are logged (once).
SLOW_SHUTDOWN_S = 15.0

CANCEL_WAIT_S = 5.0  # how long a cancel call waits for the generation to stop before answering


class Service:
    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics or Metrics()
        self._watch_engine(engine)
        self.registry = Registry(settings, self.metrics)
        # Start-time adapters were loaded with the engine (shared/engine/vllm_startup.py, `open_engine`).
        self.adapters = Adapters(settings, engine, self.metrics, engine.static_adapters)
        self.metrics.watch_held(lambda: self.registry.stats()["held_requests"])
        self.pacing = StreamPacing(settings.stream_batch_at, engine, self.registry)
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-tokenizer")
        side = EngineSide(settings, engine, self.metrics, self.adapters, self.pacing, self._tokenizer_thread)
        self._identity = identity_for(settings, self.registry, self.metrics, Continuation(side))
        self._starter = Starter(side, self.registry)
        self._stats_task: asyncio.Task[None] | None = None
        self.telemetry: Telemetry | None = None  # OTLP export, set by the assembly when it is on
        if settings.engine_stats_file is not None:
            publisher = publish_engine_stats(
                engine, settings.engine_stats_file, settings.engine_stats_interval_s
            )
            self._stats_task = asyncio.get_running_loop().create_task(publisher)

    def _watch_engine(self, engine: Engine) -> None:
        """The engine's own gauges: running requests, output timings, the paths it found."""
        self.metrics.watch_engine(engine.running_requests)
        timings = engine.output_timings  # vLLM's engine only (shared/obs/engine_outputs.py)
        if timings is not None:
            self.metrics.watch_engine_outputs(timings)
        features = engine.features  # vLLM's engine only (shared/engine/vllm_features.py)
        if features is not None:
            self.metrics.show_engine_features((feature.name, feature.path) for feature in features.found)
        figures = engine.scheduler_figures  # vLLM's, with BUNDLE_SCHEDULER_STATS
        if figures is not None:
            self.metrics.watch_scheduler(figures)

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
        request_traces.note_request(request_id, body.model, adapter=body.model != self.settings.model_name)
        if request_id is None:
            return self._open_here(kind, body, None, None, last_event_id, event_ids=event_ids)
        self.adapters.resolve(body.model)  # 404 before any claim in a shared store
        fingerprint = request_fingerprint(kind, body)
        placing = self._identity.place(request_id, fingerprint, body.stream, last_event_id, numbered=event_ids)
        async with placing as placement:
            if placement.elsewhere is not None:
                request_traces.note_event("attach", **{"bundle.where": "another replica"})
                return placement.elsewhere
            opened = self._open_here(kind, body, request_id, fingerprint, last_event_id, event_ids=event_ids)
            return placement.here(opened)

    def _open_here(
        self,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None,
        fingerprint: str | None,
        last_event_id: int | None,
        *,
        event_ids: bool,
    ) -> Subscription:
        """`open` on this replica's registry (`fingerprint`: the body's, given with an id). Runs
        without awaiting on purpose: between the lookup and the start nothing else can run, so
        two simultaneous requests with one id can never start two generations. A resume
        (`last_event_id` given) never starts one: a fresh generation under the old event ids
        would splice two different texts together."""
        if last_event_id is not None and request_id is None:
            raise InvalidRequest("Last-Event-ID needs the X-Request-Id of the stream to resume")
        resume = last_event_id is not None
        entry, attached = self._existing_or_new(
            kind, body, request_id, fingerprint, resume=resume, event_ids=event_ids
        )
        after = last_event_id or 0
        if entry.output.stream:
            entry.output.events.check_resumable(after)
        if attached:  # counted once the resume point is known to be good
            self.metrics.replayed_requests.inc()
            request_traces.note_event(_reader_kind(resume, entry.output.done), **{"bundle.after_event": after})
        return self.registry.subscribe(entry, after)

    async def cancel(self, request_id: str) -> CancelOutcome:
        """Abort the generation this id names; attached streams end with an error event."""
        request_traces.note_event("cancel", **{"bundle.request_id": request_id})
        try:
            return await self.registry.cancel(request_id, wait_s=CANCEL_WAIT_S)
        except NotFound:  # another replica's, if a store is shared; else NotFound again
            return await self._identity.cancel(request_id, CANCEL_WAIT_S)

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
        self,
        kind: Kind,
        body: OpenAIRequest,
        request_id: str | None,
        fingerprint: str | None,
        *,
        resume: bool,
        event_ids: bool,
    ) -> tuple[Entry, bool]:
        """The generation to read, and whether it already existed (an attach, resume or replay).
        Only a named request can be matched again, so only a named one has a fingerprint."""
        self.adapters.resolve(body.model)  # 404 model_not_found unless the base or a loaded adapter
        if request_id is not None and fingerprint is not None:
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
        entry = self._starter.start(self._identity, kind, body, request_id, fingerprint, numbered=numbered)
        return entry, False


def _reader_kind(resume: bool, done: bool) -> str:
    """How a request read an existing generation, as its trace names it."""
    if resume:
        return "resume"
    return "replay" if done else "attach"


def identity_for(
    settings: Settings, registry: Registry, metrics: Metrics, continuation: Continuation | None = None
) -> Identity:
    """The shared store when BUNDLE_REDIS_URL is set, else this process alone (logged, since a
    retry that reaches another replica is then not matched)."""
    if settings.redis_url is None:
        log.info(
            "request identity: this process only (BUNDLE_REDIS_URL is not set); a retry or resume "
            "that reaches another replica is not matched"
        )
        return LocalIdentity()
    from shared.replicas.replicated import Replicas  # redis is imported only when a store is configured

    return Replicas(settings, registry, metrics, continuation)
