"""The settings sections of serving beyond the engine: request identity across replicas, how
tokens stream, logs, and the telemetry that leaves the container (`Settings` inherits them).

`Section` is every section's base (shared/settings.py says why the sections are flat).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field, SecretStr

from shared.env_values import empty_is_none


class Section(BaseModel):
    """A group of settings. Only `Settings`, which inherits every section, is ever built."""


class IdentitySection(Section):
    """Request identity (X-Request-Id): de-duplication, replay, resume and disconnects."""

    disconnect_grace_s: float = Field(
        30.0, ge=0, description="Seconds a generation with X-Request-Id outlives its clients."
    )
    retention_s: float = Field(300.0, ge=0, description="Seconds finished results stay replayable.")
    max_held_requests: int = Field(4096, ge=1, description="Finished results kept for replay.")
    max_events_per_request: int = Field(
        16384, ge=16, description="Replay buffer per generation; older events are dropped."
    )
    responses_retention_s: float = Field(
        3600.0, gt=0, description="Seconds a stored response (/v1/responses) can be fetched or continued."
    )
    responses_max_stored: int = Field(10000, ge=1, description="Stored responses kept; oldest dropped first.")
    responses_max_record_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="Bytes of one stored response with its conversation; larger ones are not kept.",
    )
    redis_url: Annotated[SecretStr | None, BeforeValidator(empty_is_none)] = Field(
        None,
        description="redis:// or rediss:// URL of a Redis/Valkey server shared by all replicas: one "
        "generation per X-Request-Id and resume on any replica. Unset: identity is per process.",
    )
    # Milliseconds, not seconds: see the module's docstring.
    redis_write_window_ms: float = Field(
        10.0,
        ge=0,
        le=1000,
        description="Milliseconds. The events of shared streams are written to the store together, "
        "at most once per this window: fewer round trips per token, and followers on other "
        "replicas see events up to this much later (0: one write per event-loop turn). Used "
        "only with BUNDLE_TAKEOVER=false: with takeover, events are written at once.",
    )
    takeover: bool = Field(
        True,
        description="With BUNDLE_REDIS_URL: when a replica running a generation is lost (or shuts "
        "down), another continues it from its log under the same event ids (docs/replicas.md). "
        "Events reach clients only once the store holds them. Off: such streams end with "
        "producer_lost.",
    )


class StreamingSection(Section):
    """How tokens reach a streaming client, in how many events and writes."""

    stream_interval: int | None = Field(
        None,
        ge=1,
        description="Output tokens vLLM gathers per streamed delta after the first (which is "
        "always sent at once, as is the last). Unset: vLLM's default, 1 (every token its own SSE "
        "event). A larger value cuts the API process's per-token work, which shares the event "
        "loop with request admission; streams then arrive in chunks of this many tokens.",
    )
    # Milliseconds, not seconds: see the module's docstring.
    stream_coalesce_ms: float = Field(
        0.0,
        ge=0,
        description="Milliseconds to wait to pack several token events into one write "
        "(0: write as soon as events exist; a slow reader still gets a backlog in one write).",
    )
    # Off by default: two H200 leases measured 4 % less serving CPU per token at 256 streams
    # with them on, inside the runs' spread and under the 5 % that keeping a reach into
    # uvicorn's internals on for everyone needs (docs/performance.md, Direct writes).
    stream_direct_writes: bool = Field(
        False,
        description="Write a caught-up stream's SSE events onto its connection from the "
        "generation's own task, all of one event-loop turn together, when uvicorn's httptools "
        "protocol serves it (the deploy images' stack) and the client keeps up, instead of waking "
        "the response's task per token. The bytes on the wire are the same; off (the default): "
        "every event through ASGI's send (docs/performance.md, Direct writes).",
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


class ObservabilitySection(Section):
    """Logs and the engine stats file."""

    log_level: str = Field("info", description="Level of uvicorn's and the bundle's own logs.")
    access_log: bool = Field(
        True,
        description="uvicorn's one line per request. Off in the benchmark, as for vLLM's server there "
        "(--disable-uvicorn-access-log): it costs the event loop ~20-50 us per request, on the path "
        "to every first token.",
    )
    engine_stats_file: Path | None = Field(
        None, description="If set, the engine's running-request count is written here (JSON)."
    )
    engine_stats_interval_s: float = Field(
        0.05, gt=0, description="Seconds between rewrites of the engine stats file."
    )


class TelemetrySection(Section):
    """Telemetry that leaves the container (docs/observability.md): OTLP traces and metrics.

    Only the switch is read here. Everything else about the export (protocol, headers, interval,
    sampler, resource attributes) is one of the standard OTEL_* variables, which the OpenTelemetry
    SDK reads itself; the platform's own variables name the container in the resource."""

    otlp_endpoint: str | None = Field(
        None,
        validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT",
        description="The standard OTLP endpoint variable, read here only as the switch: set, traces "
        "and metrics are pushed there (shared/obs/otlp.py); unset, nothing is imported or started.",
    )
    ttft_sla_s: float = Field(
        0.5,
        gt=0,
        description="The time-to-first-token objective the P99 alert compares with, in seconds: "
        "exported as the gauge bundle_ttft_sla_seconds, so the rules follow the deploy's value.",
    )
    scheduler_stats: bool = Field(
        False,
        description="vLLM's scheduler figures (KV-cache usage, its waiting and running queues) in "
        "/metrics and OTLP. Turns vLLM's per-step stat collection on (what `--disable-log-stats` "
        "turns off): a little CPU per token in the API process. One API process only.",
    )
    engine_traces: bool = Field(
        False,
        description="With an OTLP endpoint: vLLM's own `llm_request` span (queue, prefill, decode "
        "times) in each request's trace, the client's traceparent passed on. Needs, and so turns "
        "on, BUNDLE_SCHEDULER_STATS.",
    )
    modal_task_id: str | None = Field(
        None, validation_alias="MODAL_TASK_ID", description="Set by Modal: this container's id."
    )
    modal_environment: str | None = Field(
        None, validation_alias="MODAL_ENVIRONMENT", description="Set by Modal: its environment's name."
    )
    modal_region: str | None = Field(
        None, validation_alias="MODAL_REGION", description="Set by Modal: the container's region."
    )
    replicate_model_name: str | None = Field(
        None, validation_alias="REPLICATE_MODEL_NAME", description="Set by Replicate: the model's name."
    )
    replicate_version_id: str | None = Field(
        None, validation_alias="REPLICATE_VERSION_ID", description="Set by Replicate: the model version."
    )
    replicate_deployment_name: str | None = Field(
        None,
        validation_alias="REPLICATE_DEPLOYMENT_NAME",
        description="Set by Replicate when the model runs as a deployment: its name.",
    )

    @property
    def collects_scheduler_stats(self) -> bool:
        """vLLM's own tracing needs its stat collection, which the scheduler gauges turn on."""
        return self.scheduler_stats or self.exports_engine_traces

    @property
    def exports_engine_traces(self) -> bool:
        return self.engine_traces and self.otlp_endpoint is not None
