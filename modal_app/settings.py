"""Modal-only settings: `BUNDLE_MODAL_*` variables, read by `modal_app/` and nothing else.

They live beside the Modal app, not in the core's `Settings`, because only the deploy reads
them: the serving core never needs to know which GPU Modal gave it. Their variables carry the
core's prefix (`BUNDLE_MODAL_*`), so one deploy command sets both.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.env_values import explicit_variables


class ModalSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BUNDLE_MODAL_", extra="ignore", frozen=True)

    app_name: str = "vllm-serverless-bundle"
    gpu: str = "H100"
    scaledown_window_s: int = Field(300, ge=2)
    timeout_s: int = Field(3600, ge=10)
    startup_timeout_s: int = Field(1200, ge=10)
    min_containers: int = Field(0, ge=0)
    max_containers: int | None = Field(None, ge=1)
    # For a time-to-first-token objective, both come from the measured curve:
    # `python -m cost_model.scaling --bench results/h200/bench.json --ttft-sla-s 0.5` gives
    # target 43 (P99 within 500 ms) and max 60 (P50 within it) for the 8B shape on an H200
    # (docs/observability.md, "Scaling signals"). The defaults favour throughput instead.
    max_inputs: int | None = Field(None, ge=1, description="Unset: the engine's max_num_seqs.")
    target_inputs: int | None = Field(None, ge=1, description="Unset: half of max inputs.")
    secret_name: str | None = Field(None, description="Modal Secret carrying BUNDLE_API_KEY.")
    requires_proxy_auth: bool = False
    proxy_key: str | None = Field(None, description="Modal-Key header the smoke test sends.")
    proxy_secret: SecretStr | None = Field(None, description="Modal-Secret header the smoke test sends.")
    snapshot: bool = Field(
        True,
        description="GPU memory snapshots: start, warm up and put the engine to sleep before the "
        "snapshot, wake it after each restore. Left unset, on for one GPU and off for several.",
    )

    @property
    def gpu_count(self) -> int:
        """GPUs per container, parsed by Modal's own parser (`H100:2`, `h100:2`, `A100-80GB:4`,
        `H200`), so this count is the one Modal will request. A bad count raises Modal's error."""
        from modal._utils.function_utils import parse_gpu_config

        return max(parse_gpu_config(self.gpu).count, 1)

    def use_snapshots(self) -> bool:
        """Whether the class is declared with GPU memory snapshots.

        Modal snapshots the GPU memory of single-GPU functions only. Left at its default, the
        setting follows that rule: several GPUs deploy without snapshots (every cold start then
        starts the engine: slower, but it works). Asked for explicitly with several GPUs, the
        deploy stops instead: the user said they want snapshot cold starts, and a deploy that
        silently drops them would surprise them on the bill and in latency, not at deploy.
        """
        if self.gpu_count == 1:
            return self.snapshot
        if self.snapshot and "snapshot" in self.model_fields_set:
            raise ValueError(
                f"BUNDLE_MODAL_SNAPSHOT=true needs one GPU: Modal takes GPU memory snapshots of "
                f"single-GPU functions only, and BUNDLE_MODAL_GPU={self.gpu} asks for {self.gpu_count} "
                f"(unset BUNDLE_MODAL_SNAPSHOT or set it to false)"
            )
        return False

    def concurrency(self, max_num_seqs: int, max_in_flight: int) -> tuple[int, int]:
        """`(max_inputs, target_inputs)` for `@modal.concurrent`.

        max_inputs defaults to the engine's `max_num_seqs` (after its preset): the engine batches
        at most that many sequences per step, so a container that accepted more would only queue
        them inside vLLM while another container could be serving them. Never above the core's
        admission cap `max_in_flight`, which would answer 429 to inputs Modal routed to it.
        target_inputs defaults to half of that: Modal's autoscaler starts a new container once
        the average passes the target, so the running one keeps headroom for the burst that
        arrives during the new one's cold start.
        """
        if self.max_inputs is not None and self.max_inputs > max_in_flight:
            raise ValueError(
                f"BUNDLE_MODAL_MAX_INPUTS ({self.max_inputs}) exceeds BUNDLE_MAX_IN_FLIGHT "
                f"({max_in_flight}): the container would refuse what Modal sends it"
            )
        max_inputs = self.max_inputs or min(max_num_seqs, max_in_flight)
        target = self.target_inputs or max(1, max_inputs // 2)
        if target > max_inputs:
            raise ValueError(f"BUNDLE_MODAL_TARGET_INPUTS ({target}) exceeds max inputs ({max_inputs})")
        return max_inputs, target

    def deploy_env(self) -> dict[str, str]:
        """The BUNDLE_MODAL_* variables given explicitly, so the container rebuilds the same
        decorator values when it imports the app again (secrets never travel this way)."""
        return explicit_variables(self)
