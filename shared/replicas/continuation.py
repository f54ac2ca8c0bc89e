"""The taker's side of a takeover: the rest of a generation another replica started, run on this
replica's engine from the ids its log holds (shared/replicas/takeover.py plans it).

`Replicas` (replicated.py) decides that a generation is to be taken over and owns the claim; this
module builds the generation that goes on (its output looks like the first replica's: same id,
creation time and model; its logged events held for resumes) and its producer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from shared.engine.contract import EngineDelta, SamplingRequest
from shared.errors import BundleError, ProducerLost
from shared.generation.engine_side import EngineSide
from shared.generation.output import GenerationOutput, produce
from shared.generation.registry import Entry, Producer
from shared.generation.replay import ReplayBuffer
from shared.obs import request_traces
from shared.replicas import takeover
from shared.replicas.store import Claim
from shared.streaming import ChunkEncoder

log = logging.getLogger(__name__)

LOST_AND_NOT_CONTINUED = "the replica running this generation stopped, and it cannot be continued"
NEW_ID = "start again with a new X-Request-Id"


@dataclass(frozen=True)
class Continued:
    """A generation ready to run here: it goes on from `kept` logged ids, or only ends (`refusal`)."""

    entry: Entry
    producer: Producer
    kept: int
    refusal: str | None


class Continuation:
    def __init__(self, side: EngineSide) -> None:
        self._side = side

    async def prepare(
        self, request_id: str, claim: Claim, logged: takeover.Logged, lost_at: float
    ) -> Continued:
        """The rest of a generation whose producer was lost, under `claim` (this replica's now):
        its log's events first (held for resumes), then what the engine adds after the token ids
        already sent. One that cannot be continued exactly ends with `producer_lost` instead."""
        recipe = logged.recipe
        steps = None
        if recipe is not None and logged.finish_reason is None:
            steps = await self._decode_steps(recipe, logged.ids)
        plan = takeover.plan(logged, steps)
        output = _continued_output(recipe, logged, plan, claim, self._side.settings.max_events_per_request)
        outcome = "ended" if plan.refusal else "continued"
        output.trace = request_traces.takeover_trace(request_id, outcome, plan.kept)  # before it runs
        entry = Entry(request_id=request_id, fingerprint=claim.fingerprint, output=output)

        async def producer(out: GenerationOutput, abort_reason: Callable[[], str]) -> None:
            await self._go_on(request_id, out, logged, plan, lost_at, abort_reason)

        return Continued(entry, producer, plan.kept, plan.refusal)

    def started(self, continued: Continued) -> None:
        """Counted and logged once it runs here."""
        outcome = "ended" if continued.refusal else "continued"
        self._side.metrics.takeovers.labels(outcome).inc()
        what = continued.refusal or f"{continued.kept} tokens kept"
        log.info("took over %s (%s): %s", continued.entry.request_id, outcome, what)

    async def _decode_steps(self, recipe: takeover.Recipe, ids: list[int]) -> Sequence[str | None] | None:
        """The incremental text of each logged id, in the tokenizer thread (None: this engine
        cannot decode that way)."""
        skip_special = bool(recipe.sampling["skip_special_tokens"])
        loop = asyncio.get_running_loop()
        decode = self._side.engine.decode_steps
        return await loop.run_in_executor(self._side.tokenizer_thread, decode, recipe.prompt, ids, skip_special)

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
            sampling = self._rest(request_id, logged.recipe, logged.ids, plan)
        except BundleError as exc:  # its adapter is not loaded here
            output.finish(ProducerLost(f"{LOST_AND_NOT_CONTINUED} here ({exc.message}); {NEW_ID}"))
            return
        deltas = takeover.after_sent(
            self._side.engine.generate(logged.recipe.completion_id, sampling), plan.resent
        )
        timeout = self._side.settings.request_timeout_s
        await produce(
            output, self._timed(deltas, lost_at), self._side.metrics, timeout, abort_reason, opening=False
        )

    def _rest(
        self, request_id: str, recipe: takeover.Recipe, ids: list[int], plan: takeover.Plan
    ) -> SamplingRequest:
        """The original request, its prompt extended by the kept ids and its budget reduced by them."""
        given = takeover.sampling_from(recipe)
        return replace(
            given,
            prompt_token_ids=recipe.prompt + ids[: plan.kept],
            max_tokens=plan.remaining,
            seed=takeover.continuation_seed(recipe, request_id, plan.kept),
            min_tokens=max(0, given.min_tokens - plan.kept),
            stream_interval=self._side.pacing.engine_interval(),
            adapter=self._side.adapters.resolve(recipe.model),
        )

    async def _timed(self, deltas: AsyncIterator[EngineDelta], lost_at: float) -> AsyncIterator[EngineDelta]:
        """The deltas, counted as continued tokens; the first one times the takeover."""
        first = True
        async for delta in deltas:
            if first:
                self._side.metrics.takeover_seconds.observe(time.monotonic() - lost_at)
                first = False
            self._side.metrics.continued_tokens.inc(delta.token_count)
            yield delta


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
