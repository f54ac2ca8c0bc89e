"""The record of a start-time check of third-party internals: which path each use takes.

Two checks fill it: uvicorn's and Starlette's (shared/http/server_internals.py) and coglet's
(cog/coglet_internals.py). Each use of a private member is one `Found`: `expected` where the
pinned release has the member, `platform` where the path differs by design (Python 3.11 has no
eager tasks), `fallback` where the member is missing and the bundle takes its other path. The
check is logged in one line (a warning naming the fallbacks, if any) and shown in the service's
metrics as `bundle_server_features{component,feature,path}` (shared/obs/metrics.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

Kind = Literal["expected", "platform", "fallback"]


@dataclass(frozen=True)
class Found:
    """The path one use of a third party's internals takes on the installed release."""

    component: str  # "uvicorn", "starlette", "coglet"
    feature: str
    path: str
    kind: Kind


@dataclass(frozen=True)
class InternalsCheck:
    """Every use checked, and the releases they were checked against ("uvicorn 0.54.0")."""

    releases: tuple[str, ...]
    found: tuple[Found, ...]

    def path(self, feature: str) -> str:
        return next(found.path for found in self.found if found.feature == feature)

    def fallbacks(self) -> tuple[Found, ...]:
        return tuple(found for found in self.found if found.kind == "fallback")

    def log_line(self) -> str:
        paths = ", ".join(
            f"{f.component}.{f.feature}={f.path}" + ("" if f.kind == "expected" else f" ({f.kind})")
            for f in self.found
        )
        return f"{', '.join(self.releases)}: {paths}"


def log_check(log: logging.Logger, title: str, check: InternalsCheck) -> None:
    """One line at start: `<title>: <releases>: <component>.<feature>=<path>, ...`; a warning
    naming the fallbacks when there are any (their behaviour is then the other path's)."""
    fallbacks = check.fallbacks()
    if fallbacks:
        names = ", ".join(f"{found.component}.{found.feature}" for found in fallbacks)
        log.warning("%s (fallbacks: %s): %s", title, names, check.log_line())
    else:
        log.info("%s: %s", title, check.log_line())
