"""The engine contract: what the API asks of a model server, the values that cross the seam,
and the one type of what opens an engine (`EngineFactory`).

The API only ever sees `Engine` and these value types; `shared.engine.vllm` implements it on
vLLM (started by `shared.engine.vllm_startup.open_engine`), `tests/fakes.py` and
`tests/scripted.py` stand in for it where a test needs a fault or a schedule the real engine
cannot give on demand.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from shared.settings import Settings

if TYPE_CHECKING:
    from shared.engine.lora import Adapter
    from shared.engine.scheduler_stats import SchedulerFigures
    from shared.engine.vllm_features import EngineFeatures
    from shared.obs.engine_outputs import OutputTimings


# What a request may ask of the output, and what a tool-call parser (`Engine.tool_parser`) emits:
# the API's shapers (shared/shaping/) and the vLLM adapter both speak these, so they live here,
# below both.
@dataclass(frozen=True)
class OutputConstraint:
    """A JSON schema the output must validate against, or (schema None) any JSON object."""

    json_schema: Mapping[str, Any] | None = None


@dataclass
class ToolDelta:
    """What one piece of output becomes: plain content and/or tool-call deltas."""

    content: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallShaper(Protocol):
    def feed(self, text: str, token_ids: Sequence[int]) -> ToolDelta: ...

    def finish(self) -> ToolDelta:
        """The rest, when the choice ends (calls that could only be parsed whole)."""
        ...


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_start(index: int, name: str, arguments: str) -> dict[str, Any]:
    """The first delta of a call: id, type and name, and arguments so far."""
    return {
        "index": index,
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def call_more(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


@dataclass(frozen=True)
class SamplingRequest:
    """What the engine needs for one generation, already validated and tokenized."""

    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    constraint: OutputConstraint | None = None  # structured output (JSON schema or object)
    # Tokens per output after the first (the first and the last come at once); None: the
    # engine's own interval. Only an engine with `paces_each_request` honours it.
    stream_interval: int | None = None
    adapter: Adapter | None = None  # a LoRA adapter the engine has loaded (lora.py); None: the base
    # W3C trace context for the engine's own tracing (BUNDLE_ENGINE_TRACES); None: untraced.
    trace_headers: Mapping[str, str] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and its most likely alternatives (best first)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__ (1.7 us
# here against 0.25 for this one), once per token per stream; nothing writes to a delta.
@dataclass(slots=True)
class EngineDelta:
    """New output of one choice since its previous delta (treat it as read-only)."""

    text: str
    token_count: int
    finish_reason: str | None = None
    index: int = 0  # which of the request's n choices
    token_ids: Sequence[int] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class PrefixCacheCounts:
    """Prompt tokens the engine looked up in its prefix cache, and those it found there.

    Summed from vLLM's own per-request count (`RequestOutput.num_cached_tokens`, set by its
    scheduler when it first schedules the request), which needs no stat logging: the engine's
    flags stay those of a server run with `--disable-log-stats`, on vLLM 0.26 and 0.32 alike.
    """

    queries: int = 0
    hits: int = 0

    def record(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        self.queries += prompt_tokens
        self.hits += cached_tokens or 0


@dataclass
class EngineInfo:
    model_name: str
    max_model_len: int
    vocab_size: int = 0  # 0: unknown, token-id prompts are then checked by the engine alone


class Engine(Protocol):
    """What the API needs from a model server; `tests/fakes.py` has a fault-injecting twin.

    The members at the end have a default: an engine that has nothing behind one (a test's
    stand-in) names `Engine` as its base and inherits it, so the API never asks whether an
    engine has a member. A wrapper must not inherit them: it would hide the inner engine's.
    """

    info: EngineInfo
    # Whether `SamplingRequest.stream_interval` is honoured (vLLM's per-request interval).
    paces_each_request: bool

    def tokenize(self, prompt: str) -> list[int]: ...

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]: ...

    def tool_parser(self, tools: Sequence[dict[str, Any]]) -> ToolCallShaper:
        """A fresh parser of one choice's output into tool calls (`tool_choice` "auto")."""
        ...

    def check_constraint(self, constraint: OutputConstraint, param: str) -> None:
        """Raise InvalidRequest (about `param`) unless the engine can enforce this output format.
        Asked at admission for constrained requests only: a valid schema that the engine's grammar
        backend cannot compile is the client's 400, before any 200 and never a 500."""
        ...

    def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        """Yield deltas until finished. Cancelling the iteration aborts the engine request."""
        ...

    def healthy(self) -> bool:
        """Whether the engine can serve. Cheap, never blocks, safe from any thread: health
        probes (Cog's run in a thread pool) must not queue behind a busy event loop."""
        ...

    def running_requests(self) -> int:
        """Requests the engine itself holds right now (the ground truth for leak checks)."""
        ...

    def ready(self) -> bool:
        """Alive and awake: what `/health` reports. `healthy()` stays pure liveness, so a
        sleeping engine is not mistaken for a dead one."""
        ...

    async def sleep(self) -> None:
        """Free the accelerator (weights offloaded, KV cache dropped) until `wake_up`; requests
        that arrive meanwhile wait for the wake-up. A no-op where the platform has no sleep mode."""
        ...

    async def wake_up(self) -> None:
        """Undo `sleep`; raises if the engine cannot come back (the caller must not serve then)."""
        ...

    async def add_adapter(self, adapter: Adapter) -> None:
        """Load a LoRA adapter for requests that name it; InvalidRequest if it does not fit."""
        ...

    async def remove_adapter(self, adapter: Adapter) -> None:
        """Drop an adapter once the requests running on it have ended."""
        ...

    # --- optional, with what an engine that has none reports ---------------------------------------
    @property
    def features(self) -> EngineFeatures | None:
        """The path each feature check took at start (shared/engine/vllm_features.py), shown in
        `bundle_engine_features`; None: this engine checks none."""
        return None

    @property
    def output_timings(self) -> OutputTimings | None:
        """How long the engine's step outputs wait for this process (shared/obs/engine_outputs.py);
        None: not measured."""
        return None

    @property
    def prefix_cache(self) -> PrefixCacheCounts | None:
        """Prompt tokens looked up in the prefix cache and those found there (the stats file);
        None: not counted."""
        return None

    @property
    def static_adapters(self) -> Sequence[Adapter]:
        """The LoRA adapters loaded with the engine at start (BUNDLE_LORA_MODULES)."""
        return ()

    @property
    def scheduler_figures(self) -> SchedulerFigures | None:
        """The scheduler's last-step figures (KV-cache usage, queue), where collected
        (BUNDLE_SCHEDULER_STATS on vLLM's engine); None otherwise."""
        return None

    def decode_steps(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], skip_special_tokens: bool
    ) -> list[str | None] | None:
        """The text each output id adds after the prompt, None while it ends inside a character:
        what the engine streamed for them. A takeover uses it to find where the text already
        sent ends among the ids (shared/replicas/takeover.py). None: this engine cannot tell, so
        a continuation generates every id again. CPU-bound: run it off the event loop."""
        return None


# What opens an engine for as long as the block runs (`shared.engine.vllm_startup.open_engine`,
# a test's stand-in, a snapshot's engine handed on by shared/lifecycle.py).
EngineFactory = Callable[[Settings], AbstractAsyncContextManager[Engine]]
