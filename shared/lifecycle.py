"""The engine's life in a serverless container: start, warm up, sleep, wake, stop.

A platform that snapshots memory (Modal's GPU snapshots) wants the engine started, warmed up and
asleep before the snapshot, and awake again after each restore. These are the functions its
hooks call; `bench/startup.py` and `bench/sleepwake.py` call the very same ones on the GPU, so
what is measured is what is deployed.

All of it must run on the event loop that later serves requests: vLLM's `AsyncLLM` belongs to
the loop it started on. `engine_factory` hands the engine started here to the API's lifespan,
or, when nothing was started here (the platform ran no hooks), opens one on the serving loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from shared.engine.contract import Engine, EngineFactory, SamplingRequest
from shared.engine.presets import apply_preset
from shared.engine.vllm_startup import open_engine
from shared.errors import EngineUnavailable
from shared.settings import Settings

log = logging.getLogger(__name__)

WARM_UP_SEED = 20261130  # fixed prompts: every container warms up the same kernels
# vLLM's GPU sampler (the 0.2x line, the H200's 0.26 included) masks top-k/top-p with a Triton
# kernel once a step samples at least 8 rows (fewer: a PyTorch sort; the threshold is from vLLM's
# source), JIT-compiled on first use, once per pair of "top-k on" / "top-p on" (compile-time
# constants). On the H200 that compile ("Triton kernel JIT compilation during inference:
# _topk_topp_kernel" in the log) held the engine step of the first concurrent burst of sampled
# requests: Cog's first 32-stream wave had TTFT 6.4-7.6 s, later waves 0.25-0.35 s (Cog's default
# inputs sample with top_k 50 and top_p 0.9). Greedy or unfiltered requests never run it, so the
# greedy part of warm_up() does not warm it. One wave per pair, wide enough for the Triton path;
# a mixed batch (some rows filtered, some not) runs the "both on" variant. vLLM's CPU build has
# no Triton (a PyTorch sort always), and vLLM 0.32 warms these kernels up itself.
SAMPLER_TRITON_MIN_ROWS = 8
SAMPLED_WAVES: tuple[tuple[int | None, float], ...] = ((50, 0.9), (50, 1.0), (None, 0.9))  # (top_k, top_p)


# Engines warmed in this process: Modal's snapshot hook warms its engine before the snapshot,
# and the service assembled on it after the restore (shared/assembly.py) must not warm it again.
_warmed: weakref.WeakSet[Engine] = weakref.WeakSet()


@dataclass(frozen=True)
class WakeReport:
    wake_up_s: float  # vLLM's wake_up(): weights back on the GPU, KV cache re-allocated
    first_token_s: float  # then one 1-token request, the proof that the GPU computes again

    @property
    def total_s(self) -> float:
        return self.wake_up_s + self.first_token_s


class EngineLifecycle:
    """One engine through start, warm-up, sleep and wake, owned until `stop`."""

    def __init__(self, settings: Settings, opener: EngineFactory = open_engine) -> None:
        # Sleep mode must be chosen when the engine starts; vLLM ignores it where unsupported.
        self.settings = settings.model_copy(update={"sleep_mode": True})
        self.engine: Engine | None = None
        self._opener = opener
        self._stack = AsyncExitStack()

    async def start(self) -> Engine:
        if self.engine is None:
            self.engine = await self._stack.enter_async_context(self._opener(self.settings))
        return self.engine

    async def prepare_for_snapshot(self) -> None:
        """Start, warm up (unless BUNDLE_WARM_UP=0), sleep: what runs once before a memory
        snapshot is taken. The service assembled on this engine later does not warm it again."""
        engine = await self.start()
        if self.settings.warm_up:
            await warm_up_once(engine, self.settings)
        await self.sleep()

    async def sleep(self) -> float:
        started = time.perf_counter()
        await self._engine().sleep()
        return time.perf_counter() - started

    async def wake(self) -> WakeReport:
        """Wake the engine and prove it computes. Raises `EngineUnavailable` if it cannot: the
        caller (a restore hook) must let that end the container, so that the platform replaces
        it, rather than keep a container that answers 503 forever."""
        engine = self._engine()
        started = time.perf_counter()
        try:
            await engine.wake_up()
            woke = time.perf_counter()
            await first_token(engine)
        except Exception as exc:
            log.error("wake-up failed after %.2f s: %s", time.perf_counter() - started, exc)
            raise EngineUnavailable(f"the engine did not wake up: {type(exc).__name__}: {exc}") from exc
        report = WakeReport(wake_up_s=woke - started, first_token_s=time.perf_counter() - woke)
        if report.total_s > self.settings.wake_slow_s:
            log.warning(
                "slow wake-up: %.2f s (bound %.1f s): wake_up %.2f s, first token %.2f s",
                report.total_s,
                self.settings.wake_slow_s,
                report.wake_up_s,
                report.first_token_s,
            )
        else:
            log.info("awake in %.2f s (first token %.3f s)", report.total_s, report.first_token_s)
        return report

    @property
    def started(self) -> bool:
        """Whether an engine was started here (and is not stopped yet)."""
        return self.engine is not None

    async def stop(self) -> None:
        self.engine = None
        await self._stack.aclose()

    @asynccontextmanager
    async def engine_factory(self, settings: Settings) -> AsyncIterator[Engine]:
        """For `create_app(engine_factory=...)`: the engine started here if there is one (its
        lifetime stays with `stop`), else a fresh one for the app's lifespan alone."""
        if self.engine is not None:
            yield self.engine
            return
        async with self._opener(settings) as engine:
            yield engine

    def _engine(self) -> Engine:
        if self.engine is None:
            raise EngineUnavailable("the engine was never started")
        return self.engine


async def warm_up_once(engine: Engine, settings: Settings) -> None:
    """`warm_up`, unless this engine was warmed already in this process."""
    if engine in _warmed:
        log.info("warm-up: this engine was warmed already (before the snapshot)")
        return
    await warm_up(engine, settings)
    _warmed.add(engine)


async def warm_up(engine: Engine, settings: Settings) -> None:
    """A few requests that touch what the first users would otherwise pay for: a short one, a
    long prefill, one full-batch wave of `max_num_seqs` streams, and the sampled waves that
    compile vLLM's top-k/top-p kernels (SAMPLED_WAVES)."""
    started = time.perf_counter()
    prompts = PromptMaker(engine.info.vocab_size or 256, WARM_UP_SEED)
    context = engine.info.max_model_len
    await _complete(engine, prompts.ids(16), max_tokens=16)
    await _complete(engine, prompts.ids(max(1, min(context // 2, 2048))), max_tokens=1)
    batch = apply_preset(settings).max_num_seqs  # what the engine runs with, its preset included
    wave = [_complete(engine, prompts.ids(16), max_tokens=8) for _ in range(batch)]
    await asyncio.gather(*wave)
    await _sampled_waves(engine, prompts)
    log.info(
        "warm-up done in %.2f s (%d-stream wave; %d sampled waves of %d for top-k/top-p)",
        time.perf_counter() - started,
        len(wave),
        len(SAMPLED_WAVES),
        2 * SAMPLER_TRITON_MIN_ROWS,
    )


async def _sampled_waves(engine: Engine, prompts: PromptMaker) -> None:
    """The top-k/top-p kernels' first use (see SAMPLED_WAVES): twice the rows that take them."""
    for top_k, top_p in SAMPLED_WAVES:
        wave = [
            _complete(engine, prompts.ids(16), max_tokens=4, temperature=1.0, top_k=top_k, top_p=top_p)
            for _ in range(2 * SAMPLER_TRITON_MIN_ROWS)
        ]
        await asyncio.gather(*wave)


async def first_token(engine: Engine) -> float:
    """Seconds until a 1-token request completes."""
    started = time.perf_counter()
    await _complete(engine, PromptMaker(engine.info.vocab_size or 256, 1).ids(8), max_tokens=1)
    return time.perf_counter() - started


class PromptMaker:
    """Distinct random token-id prompts: prefix caching must not turn warm-up or a measurement
    into cache hits."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._random = random.Random(seed)
        self._top = max(vocab_size - 1, 2)

    def ids(self, length: int) -> list[int]:
        return [self._random.randrange(1, self._top) for _ in range(length)]


async def _complete(
    engine: Engine,
    prompt: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> None:
    request = SamplingRequest(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        ignore_eos=True,
    )
    async for _ in engine.generate(f"lifecycle-{uuid.uuid4().hex}", request):
        pass
