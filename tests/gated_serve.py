"""`python -m tests.gated_serve --gate-dir DIR [python -m shared.serve's arguments]`: the real
server, its engine wrapped in the test gate (tests/gate.py) that reads its rules from DIR.

Test-only: the product's entry point stays free of test hooks. This one swaps the engine factory
`shared.serve.serve` uses for one that wraps the real engine, then runs the ordinary `main`.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import shared.serve
from shared.settings import Settings
from tests.gate import GatedEngine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.gated_serve", add_help=False)
    parser.add_argument("--gate-dir", type=Path, required=True)
    known, rest = parser.parse_known_args(argv)
    folder: Path = known.gate_dir
    real_factory = shared.serve.marked_engine  # fails loudly here if the product renames it

    @asynccontextmanager
    async def gated_engine(settings: Settings) -> AsyncIterator[Any]:
        async with real_factory(settings) as engine:
            yield GatedEngine(engine, folder)

    shared.serve.marked_engine = gated_engine  # type: ignore[assignment]
    shared.serve.main(rest)


if __name__ == "__main__":
    main()
