"""Target names on the command line: `kind[:preset][@processes]`, and how each kind is configured.

raw, bundle, vllm_server          the same engine flags for all three (shared/engine/vllm_startup.py)
bundle:throughput, raw:latency    the same, with a deploy preset (shared/engine/presets.py)
vllm_server:defaults              `vllm serve` with vLLM's own defaults, the bar to beat
bundle@4, vllm_server@4           4 API processes on one engine core: BUNDLE_API_PROCESSES=4, and
                                  `vllm serve --api-server-count 4` (vllm_server@1: that command
                                  with a count of 1, which is one process)
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from shared.settings import Settings

KINDS = ("raw", "bundle", "vllm_server")
DEFAULTS = "defaults"  # the one variant that is not a preset
NO_PREFIX_CACHE = "/no-prefix-cache"  # appended to a result's name when caching was off


class BadTarget(ValueError):
    """A target name the benchmark does not know."""


@dataclass(frozen=True)
class TargetSpec:
    kind: str
    variant: str | None = None  # a preset name, or DEFAULTS for vLLM's server
    processes: int | None = None  # API processes on the one engine core; None: the kind's default

    @classmethod
    def parse(cls, text: str) -> TargetSpec:
        head, _, count = text.strip().partition("@")
        kind, _, variant = head.partition(":")
        presets = typing.get_args(typing.get_args(Settings.model_fields["preset"].annotation)[0])
        if kind not in KINDS:
            raise BadTarget(f"unknown target {text!r}: one of {', '.join(KINDS)}, optionally :PRESET and @N")
        if variant and variant not in presets and not (kind == "vllm_server" and variant == DEFAULTS):
            raise BadTarget(
                f"unknown variant {variant!r} of {kind}: {', '.join(presets)} (or vllm_server:defaults)"
            )
        return cls(kind, variant or None, _processes(text, kind, count))

    @property
    def name(self) -> str:
        base = f"{self.kind}:{self.variant}" if self.variant else self.kind
        return base if self.processes is None else f"{base}@{self.processes}"

    @property
    def vllm_defaults(self) -> bool:
        return self.variant == DEFAULTS

    def settings(self, prefix_caching: bool) -> Settings:
        """The engine settings of this target: the environment's, plus the suite's explicit
        prefix-caching flag and this target's preset (vLLM's defaults take neither)."""
        if self.vllm_defaults:
            return Settings()
        return Settings(enable_prefix_caching=prefix_caching, preset=self.variant)

    def server_env(self, prefix_caching: bool) -> dict[str, str]:
        """The same settings, as the bundle's server reads them (its own process)."""
        env = {
            "BUNDLE_ENABLE_PREFIX_CACHING": "true" if prefix_caching else "false",
            "BUNDLE_PRESET": self.variant or "",  # empty: none, whatever the caller's environment says
        }
        if self.processes is not None:
            env["BUNDLE_API_PROCESSES"] = str(self.processes)
        return env

    def result_name(self, prefix_caching: bool) -> str:
        return self.name if prefix_caching or self.vllm_defaults else self.name + NO_PREFIX_CACHE


def _processes(text: str, kind: str, count: str) -> int | None:
    """`@N`'s N: raw has no API process, and N is a count of at least 1."""
    if not count and "@" not in text:
        return None
    if kind == "raw":
        raise BadTarget(f"{text!r}: raw runs no API process (@N is for bundle and vllm_server)")
    if not count.isdigit() or int(count) < 1:
        raise BadTarget(f"{text!r}: @N takes a count of API processes, 1 or more")
    return int(count)
