"""A scripted engine behind the `Engine` protocol, for fast unit tests of the core's own logic
(registry, replay, encoder) in milliseconds. It is not a stand-in for vLLM in behaviour tests:
those run the real engine. Here each generation emits exactly the tokens the test releases, so
a test controls every step without sleeping."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from shared.engine.contract import Engine, EngineDelta, EngineInfo, OutputConstraint, SamplingRequest
from shared.engine.lora import Adapter
from shared.errors import InvalidRequest


class RefusesExtras(Engine):
    """The `Engine` methods a stand-in engine has nothing behind: tool calls, constrained output
    and LoRA adapters are the client's 400, as an engine that cannot serve them answers. Its
    optional members keep the protocol's defaults (no features, timings, cache counts)."""

    def tool_parser(self, tools: Sequence[dict[str, Any]]) -> Any:
        raise InvalidRequest("tools: this test engine serves no tool calls", param="tools")

    def check_constraint(self, constraint: OutputConstraint, param: str) -> None:
        raise InvalidRequest(f"{param}: this test engine enforces no output format", param=param)

    async def add_adapter(self, adapter: Adapter) -> None:
        raise InvalidRequest(f"this test engine serves no LoRA adapters ({adapter.name!r})")

    async def remove_adapter(self, adapter: Adapter) -> None:
        return None  # none is ever added


class ScriptedEngine(RefusesExtras):
    """Every generation yields one-word tokens `t0 t1 ...`, one each time the test calls `step`
    (or all at once with `auto=True`), and finishes with "length" after `max_tokens`."""

    def __init__(self, *, auto: bool = False) -> None:
        self.info = EngineInfo(model_name="tiny", max_model_len=4096, vocab_size=1000)
        self.paces_each_request = False  # one token per delta, whatever the request asks
        self.auto = auto
        self.started: list[str] = []  # engine request ids, in order
        self.requests: list[SamplingRequest] = []  # what each generation asked for, in order
        self.aborted: list[str] = []
        self.running: dict[str, asyncio.Queue[int]] = {}
        self.tokenized_on: list[str] = []  # the thread each prompt was tokenized on

    def tokenize(self, prompt: str) -> list[int]:
        self.tokenized_on.append(threading.current_thread().name)
        return [len(word) for word in prompt.split()] or [1]

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: object = None) -> list[int]:
        return self.tokenize(" ".join(m["content"] for m in messages))

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        releases: asyncio.Queue[int] = asyncio.Queue()
        self.started.append(request_id)
        self.requests.append(request)
        self.running[request_id] = releases
        produced = 0
        try:
            while produced < request.max_tokens:
                count = request.max_tokens if self.auto else await releases.get()
                for _ in range(min(count, request.max_tokens - produced)):
                    produced += 1
                    last = produced == request.max_tokens
                    yield EngineDelta(f"t{produced - 1} ", 1, "length" if last else None)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise
        finally:
            del self.running[request_id]

    def step(self, tokens: int = 1) -> None:
        """Release `tokens` more tokens to every running generation."""
        for releases in self.running.values():
            releases.put_nowait(tokens)

    def healthy(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    def running_requests(self) -> int:
        return len(self.running)


def _conforms(engine: ScriptedEngine) -> Engine:
    return engine  # mypy (make check): the scripted engine keeps to the protocol


async def settle(rounds: int = 5) -> None:
    """Let every ready task run a few times (no wall-clock waiting)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
