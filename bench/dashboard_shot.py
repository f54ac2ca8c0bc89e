"""A picture of the Grafana dashboard's panels, drawn with matplotlib from a real Prometheus.

Grafana itself does not run here, so the panels of shared/obs/deploy/bundle-dashboard.json are
drawn the plain way: each target's expression is asked of Prometheus's `query_range` API over
the run (Grafana's `$__rate_interval` replaced by a fixed window), and each panel becomes one
plot of the series that came back, titled and labelled as the dashboard says. A panel with no
data says so. tests/test_observability.py calls `render` at the end of its run when DASHBOARD_PNG
names a file (docs/observability.md gives the command that made docs/observability-dashboard.png).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import httpx

RATE_WINDOW = "15s"


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    params: dict[str, str | float] = {"query": expr, "start": start, "end": end, "step": step}
    answer = httpx.get(f"{url}/api/v1/query_range", params=params, timeout=30).json()
    if answer["status"] != "success":
        raise RuntimeError(f"{expr}: {answer}")
    return list(answer["data"]["result"])


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda found: labels.get(found.group(1), ""), template)


def render(url: str, dashboard: Path, out: Path, start: float, end: float, step: float = 2.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(dashboard.read_text())["panels"]
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    for panel, axis in zip(panels, axes.flat, strict=False):
        _draw(axis, panel, url, start, end, step)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(f"{dashboard.name}: a run of tests/test_observability.py on the CPU test machine")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80)
    plt.close(figure)


def _draw(axis: Any, panel: dict[str, Any], url: str, start: float, end: float, step: float) -> None:
    axis.set_title(panel["title"], fontsize=10)
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
    drawn = 0
    for target in panel["targets"]:
        expr = target["expr"].replace("$__rate_interval", RATE_WINDOW)
        for series in query_range(url, expr, start, end, step):
            times = [float(t) - start for t, _ in series["values"]]
            values = [float(v) for _, v in series["values"]]
            axis.plot(times, values, label=legend(target.get("legendFormat", ""), series["metric"]) or expr)
            drawn += 1
    if drawn:
        axis.legend(fontsize=7, loc="upper left")
    else:
        note = "no data (no GPU on this machine)" if "gpu" in panel["title"].lower() else "no data"
        axis.text(0.5, 0.5, note, ha="center", va="center", transform=axis.transAxes)
    axis.set_xlabel("seconds into the run", fontsize=8)
    axis.set_ylabel(unit, fontsize=8)
    axis.tick_params(labelsize=7)
