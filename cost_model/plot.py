"""Monthly cost against request rate, one line per entry, break-evens marked (--plot)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from cost_model.analysis import RATE_RANGE, Analysis
from cost_model.breakeven import log_grid
from cost_model.catalogue import Catalogue, Entry
from cost_model.errors import CostModelError
from cost_model.estimate import monthly_cost

POINTS = 200


def plot_formats() -> list[str]:
    """The file types matplotlib itself says it can write (its canvas' own list, not ours)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def _check_tex(kind: str) -> None:
    # matplotlib lists pgf, but writes it by running a TeX system (rcParams["pgf.texsystem"]);
    # without one savefig fails only after everything is computed.
    if kind != "pgf":
        return
    import matplotlib

    tex = matplotlib.rcParams["pgf.texsystem"]
    if shutil.which(tex) is None:
        raise CostModelError(f"--plot: matplotlib writes pgf with {tex}, which is not installed")


def check_plot_path(path: Path) -> None:
    """Refuse a plot file that cannot be written, before anything is computed."""
    formats = plot_formats()
    kind = path.suffix[1:].lower()  # matplotlib picks the format from the lower-cased suffix
    if kind not in formats:
        raise CostModelError(
            f"--plot {path}: unknown format '{kind or '(no suffix)'}' (matplotlib writes: {', '.join(formats)})"
        )
    _check_tex(kind)
    parent = path.parent
    if path.is_dir():
        raise CostModelError(f"--plot {path}: is a directory")
    if not parent.is_dir():
        raise CostModelError(f"--plot {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise CostModelError(f"--plot {path}: folder {parent} is not writable")


def write_plot(path: Path, cat: Catalogue, entries: list[Entry], an: Analysis) -> None:
    # Imported here so that the rest of the tool never pays for (or needs) matplotlib.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = log_grid(*RATE_RANGE, POINTS)
    fig, ax = plt.subplots(figsize=(11, 7))
    for entry in entries:
        costs = [monthly_cost(cat, entry, an.workload, an.service, an.overrides, r) for r in rates]
        width = 2.4 if entry in an.representatives.values() else 1.0
        ax.plot(rates, costs, label=f"{entry.id} ({entry.kind})", linewidth=width)
    for be in an.break_evens:
        ax.plot([be.requests_per_day], [be.monthly_cost], "ko", markersize=7)
        ax.annotate(
            f"{be.requests_per_day:,.0f}/day",
            (be.requests_per_day, be.monthly_cost),
            textcoords="offset points",
            xytext=(6, -12),
            fontsize=8,
        )
    ax.axvline(an.workload.requests_per_day, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("requests per day")
    ax.set_ylabel("USD per month")
    ax.set_title(
        "Monthly cost by billing option (black dots: break-evens between modes; dashed: this workload)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a helper program matplotlib runs failed
        raise CostModelError(f"cannot write plot {path}: {str(exc).splitlines()[0]}") from None
    finally:
        plt.close(fig)
