"""The dashboard's and the alert rules' PromQL, read from shared/obs/deploy/, for the tests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "shared" / "obs" / "deploy"
DASHBOARD = DEPLOY / "bundle-dashboard.json"
RULES = DEPLOY / "bundle-rules.yml"
RULES_TEST = DEPLOY / "bundle-rules.test.yml"
# Names only a GPU gives (NVML): absent on a CPU machine, from /metrics and OTLP alike.
GPU_ONLY = frozenset({"bundle_gpu_memory_used_bytes", "bundle_gpu_memory_total_bytes"})
# A comparison between two spaces (the rules file's convention; label matchers have none).
COMPARISON = re.compile(r" (>=|<=|==|!=|>|<) ")


def dashboard_queries(rate_window: str) -> list[str]:
    """Every target's expression, Grafana's `$__rate_interval` replaced by `rate_window`."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [
        target["expr"].replace("$__rate_interval", rate_window)
        for panel in panels
        for target in panel["targets"]
    ]


def alert_expressions() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def with_bool_comparisons(expr: str) -> str:
    """`a > b` as `a > bool b`: a sample wherever the operands have one, firing or not."""
    return COMPARISON.sub(lambda found: f" {found.group(1)} bool ", expr)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bbundle_[a-z0-9_]+", expr))
