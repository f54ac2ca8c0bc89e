"""A fault-injecting engine, for the one failure the real engine cannot produce on demand:
dying in the middle of a stream. Everything else in the suite runs the real vLLM engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from shared.engine.contract import Engine, EngineDelta, EngineInfo, SamplingRequest
from shared.errors import EngineUnavailable
from shared.settings import Settings
from tests.scripted import RefusesExtras


class DyingEngine(RefusesExtras):
    """Streams `die_after` one-character tokens, then dies like vLLM's EngineDeadError does."""

    def __init__(self, die_after: int = 3) -> None:
        self.info = EngineInfo(model_name="tiny", max_model_len=2048)
        self.paces_each_request = False
        self.die_after = die_after
        self.dead = False
        self.running = 0

    def tokenize(self, prompt: str) -> list[int]:
        return [ord(c) % 256 for c in prompt]

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: object = None) -> list[int]:
        return self.tokenize("".join(m["content"] for m in messages))

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        if self.dead:
            raise EngineUnavailable("the engine is not running")
        self.running += 1
        try:
            for index in range(self.die_after):
                await asyncio.sleep(0.01)
                yield EngineDelta(text=chr(ord("a") + index), token_count=1)
            self.dead = True
            raise EngineUnavailable("the engine died during generation")
        finally:
            self.running -= 1

    def healthy(self) -> bool:
        return not self.dead

    def running_requests(self) -> int:
        return self.running

    def ready(self) -> bool:
        return not self.dead  # never sleeps

    async def sleep(self) -> None:
        pass

    async def wake_up(self) -> None:
        pass


def _conforms(engine: DyingEngine) -> Engine:
    return engine  # mypy (make check): the dying engine keeps to the protocol


@asynccontextmanager
async def dying_engine(settings: Settings) -> AsyncIterator[DyingEngine]:
    yield DyingEngine()
