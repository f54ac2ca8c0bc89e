"""The one settings object. Every knob of the bundle lives here; nothing else reads the environment.

Each field maps to an environment variable with the ``BUNDLE_`` prefix (``model`` is
``BUNDLE_MODEL``). Tests and wrappers build ``Settings(...)`` with keyword overrides instead of
touching ``os.environ``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

TINY_MODEL = "tiny"  # the embedded random-weight Llama; see shared/tiny_model.py


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "vllm-serverless-bundle"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BUNDLE_", extra="ignore", frozen=True)

    # --- what is served -------------------------------------------------------------------
    model: str = Field(
        TINY_MODEL,
        description="'tiny' (random-weight local test model), a Hugging Face id or a local path.",
    )
    model_revision: str | None = Field(None, description="Git revision of a Hugging Face model.")
    served_model_name: str | None = Field(
        None, description="Name clients send as `model`; defaults to BUNDLE_MODEL."
    )
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    tiny_model_shape: Literal["tiny", "llama3-8b"] = Field(
        "tiny", description="Shape of the built-in model: 'llama3-8b' is config-only (dummy load)."
    )
    tiny_model_seed: int = 0

    # --- engine arguments (passed to vLLM's AsyncEngineArgs) -------------------------------
    preset: Literal["throughput", "latency", "fast-boot"] | None = Field(
        None,
        description="Named engine knobs (shared/presets.py); an engine field set explicitly wins.",
    )
    dtype: str = "auto"
    max_model_len: int | None = None
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
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_prefix_caching: bool | None = None
    block_size: int | None = Field(None, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    quantization: str | None = None
    speculative_config: dict[str, Any] | None = Field(
        None, description='JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}.'
    )
    load_format: str = Field("auto", description="'dummy' fills random weights (benchmarks).")
    cuda_graph_max_batch: int | None = Field(
        None,
        ge=1,
        description="Largest step, in tokens, captured as a CUDA graph. Unset: vLLM's own default "
        "(twice max_num_seqs, at most 512). The sizes serve mixed prefill + decode steps too, "
        "so a cap at max_num_seqs slows sustained load (see README, cold start). "
        "Ignored with enforce_eager and with speculative decoding (vLLM sizes those itself).",
    )
    stream_interval: int | None = Field(
        None,
        ge=1,
        description="Output tokens vLLM gathers per streamed delta after the first (which is "
        "always sent at once, as is the last). Unset: vLLM's default, 1 (every token its own SSE "
        "event). A larger value cuts the API process's per-token work, which shares the event "
        "loop with request admission; streams then arrive in chunks of this many tokens.",
    )
    trust_remote_code: bool = False
    engine_seed: int = 0

    # --- sleep mode (GPU memory snapshots) ---------------------------------------------------
    sleep_mode: bool = Field(
        False,
        description="Start vLLM with sleep mode (CUDA only; ignored on the CPU build) so the "
        "engine can sleep before a memory snapshot and wake after restore. The Modal snapshot "
        "path turns it on.",
    )
    wake_wait_s: float = Field(
        30.0,
        gt=0,
        description="How long a request that arrives while the engine sleeps waits for "
        "the wake-up before it fails with 503.",
    )
    wake_slow_s: float = Field(
        5.0, gt=0, description="A wake-up slower than this is logged as a warning with its phases."
    )
    warm_up: bool = Field(
        True,
        description="Run a few requests before serving (shared/lifecycle.py, warm_up) so the first "
        "users do not pay for first-use compiles: on the H200 the first sampled burst waited 10 s "
        "for vLLM's top-k/top-p kernel without it. Off saves ~1.5 s per start on the CPU build.",
    )

    # --- LoRA adapters (shared/lora.py) -------------------------------------------------------
    enable_lora: bool = Field(
        False, description="Serve LoRA adapters beside the base model; a request picks one by `model`."
    )
    # NoDecode: the settings source would insist on JSON; the validator below takes both forms.
    lora_modules: Annotated[dict[str, str], NoDecode] = Field(
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

    # --- API -------------------------------------------------------------------------------
    api_key: SecretStr | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: str = "info"
    access_log: bool = Field(
        True,
        description="uvicorn's one line per request. Off in the benchmark, as for vLLM's server there "
        "(--disable-uvicorn-access-log): it costs the event loop ~20-50 us per request, on the path "
        "to every first token.",
    )

    # --- request limits --------------------------------------------------------------------
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request sets none.")
    max_prompt_tokens: int = Field(8192, ge=1)
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_in_flight: int = Field(512, ge=1, description="Generations admitted at once; then 429.")
    max_n: int = Field(8, ge=1, description="Most choices (`n`) one request may ask for.")
    compact_json: bool = Field(
        True, description="Structured output without free whitespace (vLLM's disable_any_whitespace)."
    )
    tool_call_parser: str = Field(
        "llama3_json",
        description="vLLM tool parser for tool_choice 'auto' ('llama3_json' fits the default Llama "
        "3.1 Instruct and the tiny model; 'hermes' fits Hermes/Qwen <tool_call> tags).",
    )
    retry_after_s: int = Field(1, ge=0)

    # --- hostile clients and process lifetime (see shared/http_limits.py) --------------------
    max_header_count: int = Field(100, ge=16, description="Headers one request may carry; then 431.")
    max_header_bytes: int = Field(
        32_768, ge=4096, description="Request line plus headers, in bytes; then 431 (before auth)."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Time a connection has to deliver a request's headers, and then a body of up to "
        "256 KiB; then 408.",
    )
    keep_alive_s: int = Field(30, ge=1, description="Idle keep-alive connections close after this.")
    shutdown_grace_s: float = Field(
        10.0,
        ge=0,
        description="After SIGTERM, running streams get this long to finish; then they end with a "
        "'server shutting down' error event. Keep it inside the platform's kill grace.",
    )

    # --- request identity, resume and disconnects -------------------------------------------
    disconnect_grace_s: float = Field(
        30.0, ge=0, description="How long a generation with X-Request-Id outlives its clients."
    )
    retention_s: float = Field(300.0, ge=0, description="How long finished results are replayable.")
    max_held_requests: int = Field(4096, ge=1, description="Finished results kept for replay.")
    max_events_per_request: int = Field(
        16384, ge=16, description="Replay buffer per generation; older events are dropped."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Upper bound on one generation.")
    redis_url: SecretStr | None = Field(
        None,
        description="redis:// or rediss:// URL of a Redis/Valkey server shared by all replicas: one "
        "generation per X-Request-Id and resume on any replica. Unset: identity is per process.",
    )
    redis_write_window_ms: float = Field(
        10.0,
        ge=0,
        le=1000,
        description="The events of shared streams are written to the store together, at most once "
        "per this window: fewer round trips per token, and followers on other replicas see events "
        "up to this much later (0: one write per event-loop turn).",
    )

    engine_stats_file: Path | None = Field(
        None, description="If set, the engine's running-request count is written here (JSON)."
    )
    engine_stats_interval_s: float = Field(0.05, gt=0)

    # --- streaming -------------------------------------------------------------------------
    stream_coalesce_ms: float = Field(
        0.0,
        ge=0,
        description="Wait up to this long to pack several token events into one write "
        "(0: write as soon as events exist; a slow reader still gets a backlog in one write).",
    )
    stream_batch_at: int | None = Field(
        None,
        ge=1,
        description="While at least this many generations run on this replica, streams get "
        "their tokens in pairs after the first. Where vLLM takes a per-request stream interval (0.32 "
        "on), a generation admitted then asks it for 2 tokens per output: half of vLLM's own "
        "output work per token, and of the bundle's. On an older vLLM a stream instead waits "
        "for two new events per write after its first two: half the event loop's wake-ups and "
        "socket writes, the SSE events themselves unchanged. Unset: every token as it is made.",
    )

    @field_validator("preset", mode="before")
    @classmethod
    def _no_preset(cls, value: Any) -> Any:
        # BUNDLE_PRESET= or BUNDLE_PRESET=none: no preset, even where a deploy defaults to one.
        return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip():
            return json.loads(value)
        return value or None

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_modules(cls, value: Any) -> Any:
        """JSON object, or `name=source,name=source` (the form RunPod's LORA_MODULES users know)."""
        if not isinstance(value, str):
            return value or {}
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            return json.loads(text)
        pairs = [part.partition("=") for part in text.split(",") if part.strip()]
        if any(not sep or not name.strip() or not source.strip() for name, sep, source in pairs):
            raise ValueError("BUNDLE_LORA_MODULES takes JSON or name=source pairs separated by commas")
        return {name.strip(): source.strip() for name, _, source in pairs}

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return value or None  # BUNDLE_REDIS_URL= (empty) means no shared store

    @property
    def model_name(self) -> str:
        """The name clients use in the `model` field."""
        return self.served_model_name or self.model

    @property
    def lora_dir(self) -> Path:
        return self.lora_cache_dir or self.cache_dir / "lora"

    @property
    def uses_tiny_model(self) -> bool:
        return self.model == TINY_MODEL

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
        env: dict[str, str] = {}
        for name in sorted(self.model_fields_set):
            value = getattr(self, name)
            if value is None or isinstance(value, SecretStr):
                continue
            if isinstance(value, bool):
                rendered = "true" if value else "false"
            elif isinstance(value, dict):
                rendered = json.dumps(value)
            else:
                rendered = str(value)
            env[f"BUNDLE_{name.upper()}"] = rendered
        return env
