"""A replica for tests/test_takeover.py: `python -m shared.serve`'s server on the real engine, whose
engine outputs pass a gate the test controls, so "after k tokens" never depends on how fast the
tiny model runs. Run as `python -m tests.takeover_replica` with every BUNDLE_* setting, and
TAKEOVER_GATE naming the gate's file.

The gate (a file, so a test can drive a replica in another process that it later kills):
- absent, or `{"hold_after": null}`: outputs pass;
- `{"hold_after": k}`: each generation passes engine outputs while they bring it to at most k
  tokens, and holds the first that would take it past k until the file says otherwise. Each
  generation that starts holding appends a line to the file `<gate>.held`, so the test waits for
  "all held" instead of sleeping.

Tokens, not outputs: when its reader falls behind (a loaded machine), vLLM merges a request's
outputs into one, so the number of outputs depends on the machine's speed; a held generation has
always sent at most k tokens, and never its end.

Its gate is its own: one file for every generation, counted in tokens (tests/gate.py holds only
the generations whose prompt names a rule, counted in outputs).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson

from shared.engine.contract import Engine, EngineDelta, SamplingRequest
from shared.engine.vllm_startup import open_engine
from shared.engine.wrapper import EngineWrapper
from shared.settings import Settings

GATE_VARIABLE = "TAKEOVER_GATE"
POLL_S = 0.02  # how often a held generation looks at the gate again


class FileGate:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.held_log = path.with_name(path.name + ".held")
        self._seen: tuple[int, int | None] = (-1, None)  # (mtime_ns, hold_after) last read

    def set(self, hold_after: int | None) -> None:
        """Write a new rule (atomically: a reader never sees half a file)."""
        fresh = self.path.with_name(self.path.name + ".new")
        fresh.write_bytes(orjson.dumps({"hold_after": hold_after}))
        fresh.replace(self.path)

    def held(self) -> int:
        """How many generations started holding so far."""
        return len(self.held_log.read_text().splitlines()) if self.held_log.exists() else 0

    def hold_after(self) -> int | None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime != self._seen[0]:
            self._seen = (mtime, orjson.loads(self.path.read_bytes())["hold_after"])
        return self._seen[1]

    async def pass_output(self, count: int, request_id: str) -> None:
        """Return once an output that brings its generation to `count` tokens may go on."""
        limit = self.hold_after()
        if limit is None or count <= limit:
            return
        with self.held_log.open("a") as log:
            log.write(f"held {request_id}\n")
        while (limit := self.hold_after()) is not None and count > limit:
            await asyncio.sleep(POLL_S)


class GatedEngine(EngineWrapper):
    """The real engine, each generation's outputs passed through the gate."""

    def __init__(self, engine: Engine, gate: FileGate) -> None:
        super().__init__(engine)  # everything but `generate` is the engine's own
        self._gate = gate

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        tokens = 0
        async for delta in self.inner.generate(request_id, request):
            tokens += delta.token_count
            await self._gate.pass_output(tokens, request_id)
            yield delta


def main() -> None:
    from shared.engine.vllm_startup import import_vllm, resolve_model_path
    from shared.http.api import create_app
    from shared.http.process import run_server
    from shared.server_state import ExitRequest

    settings = Settings()
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("shared").setLevel(settings.log_level.upper())
    import_vllm()
    resolve_model_path(settings)
    gate = FileGate(Path(os.environ[GATE_VARIABLE]))

    @asynccontextmanager
    async def gated(settings: Settings) -> AsyncIterator[Engine]:
        async with open_engine(settings) as engine:
            yield GatedEngine(engine, gate)  # type: ignore[misc]

    def make_app(request_exit: ExitRequest) -> Any:
        return create_app(settings, engine_factory=gated, request_exit=request_exit)

    code = run_server(settings, make_app)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
