"""`EngineWrapper`: an engine that passes every member of the `Engine` contract on to another,
by hand; a wrapper (the server's guard, a test's gate) overrides only what it changes.

It does not name `Engine` as a base on purpose: it would inherit the protocol's defaults for the
optional members and so hide the wrapped engine's own. A member the protocol gains and this
class lacks fails mypy at `_passes_every_member` instead of passing silently.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from shared.engine.contract import (
    Engine,
    EngineDelta,
    OutputConstraint,
    PrefixCacheCounts,
    SamplingRequest,
    ToolCallShaper,
)

if TYPE_CHECKING:
    from shared.engine.lora import Adapter
    from shared.engine.scheduler_stats import SchedulerFigures
    from shared.engine.vllm_features import EngineFeatures
    from shared.obs.engine_outputs import OutputTimings


class EngineWrapper:
    def __init__(self, engine: Engine) -> None:
        self.inner = engine
        # Set when the engine starts and never changed after, so read once.
        self.info = engine.info
        self.paces_each_request = engine.paces_each_request

    def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        return self.inner.generate(request_id, request)

    def running_requests(self) -> int:
        return self.inner.running_requests()

    def healthy(self) -> bool:
        return self.inner.healthy()

    def ready(self) -> bool:
        return self.inner.ready()

    def tokenize(self, prompt: str) -> list[int]:
        return self.inner.tokenize(prompt)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.inner.render_chat(messages, tools)

    def tool_parser(self, tools: Sequence[dict[str, Any]]) -> ToolCallShaper:
        return self.inner.tool_parser(tools)

    def check_constraint(self, constraint: OutputConstraint, param: str) -> None:
        self.inner.check_constraint(constraint, param)

    def decode_steps(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], skip_special_tokens: bool
    ) -> list[str | None] | None:
        return self.inner.decode_steps(prompt_ids, output_ids, skip_special_tokens)

    async def sleep(self) -> None:
        await self.inner.sleep()

    async def wake_up(self) -> None:
        await self.inner.wake_up()

    async def add_adapter(self, adapter: Adapter) -> None:
        await self.inner.add_adapter(adapter)

    async def remove_adapter(self, adapter: Adapter) -> None:
        await self.inner.remove_adapter(adapter)

    @property
    def features(self) -> EngineFeatures | None:
        return self.inner.features

    @property
    def output_timings(self) -> OutputTimings | None:
        return self.inner.output_timings

    @property
    def prefix_cache(self) -> PrefixCacheCounts | None:
        return self.inner.prefix_cache

    @property
    def static_adapters(self) -> Sequence[Adapter]:
        return self.inner.static_adapters

    @property
    def scheduler_figures(self) -> SchedulerFigures | None:
        return self.inner.scheduler_figures


def _passes_every_member(engine: EngineWrapper) -> Engine:
    return engine  # mypy (make check): EngineWrapper has every member of `Engine`
