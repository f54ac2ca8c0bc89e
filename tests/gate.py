"""A gate around the REAL engine: it holds one generation's output until the test releases it.

"Still running" is then a state the test sets, not a race against a 2-layer model that writes a
thousand tokens before the test has read eight events.

How it works. `GatedEngine` wraps any `Engine` (the real vLLM one in practice) and reads its
rules from a control folder; the test's side, `Gate`, writes them there. One mechanism serves
both kinds of server the suite runs:
- in-process (tests/conftest.py): `LiveServers` wraps the session's one engine; take the `gate`
  fixture, which also releases whatever the test left held when it ends, failed or not;
- in a subprocess: start the server as `python -m tests.gated_serve --gate-dir DIR [serve args]`
  (tests/gated_serve.py; tests/real_server.py does it) and drive it with `Gate(DIR)`.

A rule is keyed by a word in the prompt, so other tests sharing the engine are never held:

    with gate.hold(after=3) as held:  # hold after 3 deltas; `after=0`: before the engine sees it
        body = long_chat(messages=[{"role": "user", "content": held.prompt("tell me a story")}])
        ...  # start the request (a thread, a task, another replica...)
        held.wait_held()  # or `await held.until_held()` in an async test
        ...  # act: cancel, disconnect, kill, read the state; the generation cannot end meanwhile
        held.release()  # or leave the block, which releases too

Every generation whose prompt contains `held.key` is held while the rule is closed (a replayed
or duplicated body is held too); `wait_held(count=2)` waits for two. A generation that ends
before its `after` deltas makes `wait_held` fail at once with a clear message, not time out.

What "held" means for the engine. By default only the output is held: the wrapper stops reading
vLLM's stream, and vLLM, which has no per-request pause, finishes the request in the background
and keeps its remaining output (merged) for the wrapper, which hands it on after the release.
The API sees a generation that is still running; vLLM's own count of running requests does not.
A test that needs the ENGINE to hold the request (its running count, an abort that reaches a
live request, an engine killed under it) asks `hold(freeze_engine=True)`: once the `after`
deltas are through, the gate pauses vLLM's scheduler (`pause_generation(mode="keep")`), which
freezes EVERY request on that engine until the release resumes it. Use it only where nothing
else needs that engine meanwhile (the session's engine between tests, a replica of one's own).
The pause lands within a step or two, so leave the request room: max_tokens far above `after`.

The control folder: `<key>.hold` (a closed rule, JSON: after, freeze_engine), `<key>.open` (the
release), `<key>.held` and `<key>.early` (one line per generation held / ended before `after`).
Files, because the server may be another process; a poll every POLL_S is cheap for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.engine.contract import Engine, EngineDelta, SamplingRequest
from shared.engine.wrapper import EngineWrapper

POLL_S = 0.01  # how often a held generation looks for its release, and a test for the hold
THAW_TIMEOUT_S = 60.0  # resuming a paused engine takes milliseconds; this only stops a hang
HELD_TIMEOUT_S = 300.0  # a cold engine on the busy 2-core box; a hold usually lands in well under 1 s


@dataclass(frozen=True)
class _Rule:
    """The engine's view of one closed rule."""

    folder: Path
    key: str
    after: int
    freeze_engine: bool

    def is_open(self) -> bool:
        return (self.folder / f"{self.key}.open").exists()

    def note(self, kind: str) -> None:
        with (self.folder / f"{self.key}.{kind}").open("a") as out:
            out.write("1\n")


def _closed_rules(folder: Path) -> list[_Rule]:
    rules = []
    for path in folder.glob("*.hold"):
        key = path.stem
        with contextlib.suppress(FileNotFoundError, ValueError):  # released while being read
            spec = json.loads(path.read_text())
            rule = _Rule(folder, key, int(spec["after"]), bool(spec["freeze_engine"]))
            if not rule.is_open():
                rules.append(rule)
    return rules


class GatedEngine(EngineWrapper):
    """`engine`, holding the generations that the rules in `folder` name (see the module); every
    other member of the contract is the engine's own (`EngineWrapper`)."""

    def __init__(self, engine: Engine, folder: Path) -> None:
        super().__init__(engine)
        self._folder = folder
        self._decode: Callable[[Sequence[int]], str] | None = None
        self._frozen = 0  # holds that keep the engine paused right now

    @property
    def llm(self) -> Any:
        """vLLM's AsyncLLM behind the gate (a real engine's: the gate pauses it)."""
        return self.inner.llm  # type: ignore[attr-defined]

    async def generate(self, request_id: str, request: SamplingRequest) -> AsyncIterator[EngineDelta]:
        rule = self._rule_for(request.prompt_token_ids)
        if rule is None:
            async for delta in self.inner.generate(request_id, request):
                yield delta
            return
        waiting = True  # for the hold; it comes once per generation
        if rule.after == 0:
            await self._hold(rule)
            waiting = False
        passed = 0
        async for delta in self.inner.generate(request_id, request):
            yield delta
            passed += 1
            # Never after a finishing delta: the API would already have its end.
            if waiting and passed >= rule.after and delta.finish_reason is None:
                await self._hold(rule)
                waiting = False
        if waiting:
            rule.note("early")

    def _rule_for(self, prompt_token_ids: Sequence[int]) -> _Rule | None:
        rules = _closed_rules(self._folder)
        if not rules:  # the common case: decode nothing
            return None
        prompt = self._decoder()(prompt_token_ids)
        return next((rule for rule in rules if rule.key in prompt), None)

    def _decoder(self) -> Callable[[Sequence[int]], str]:
        if self._decode is None:
            tokenizer = self.llm.get_tokenizer()  # type: ignore[attr-defined]
            self._decode = tokenizer.decode
        return self._decode

    async def _hold(self, rule: _Rule) -> None:
        """Wait for the release; a cancelled generation (abort, disconnect) stops waiting at once."""
        if rule.freeze_engine:
            self._frozen += 1
        try:
            if rule.freeze_engine and self._frozen == 1:
                await self.llm.pause_generation(mode="keep", clear_cache=False)  # type: ignore[attr-defined]
            rule.note("held")
            while not rule.is_open():  # noqa: ASYNC110  (another process may write the release)
                await asyncio.sleep(POLL_S)
        finally:
            if rule.freeze_engine:
                self._frozen -= 1
                if self._frozen == 0:
                    # Shielded: a second cancel (a shutdown after an abort) must not leave it paused.
                    await asyncio.shield(self._thaw())

    async def _thaw(self) -> None:
        if not self.inner.healthy():  # a dead engine has nothing to resume
            return
        try:
            # Bounded: a core that died a moment ago may never answer (vLLM has not noticed yet).
            async with asyncio.timeout(THAW_TIMEOUT_S):
                await self.llm.resume_generation()  # type: ignore[attr-defined]
        except Exception:
            if self.inner.healthy():
                raise


class Hold:
    """The test's handle on one rule (made by `Gate.hold`)."""

    def __init__(self, folder: Path, key: str) -> None:
        self.folder = folder
        self.key = key

    def prompt(self, text: str) -> str:
        """`text` with this rule's key in it: the prompt of a generation to hold."""
        return f"{self.key} {text}"

    def held_count(self) -> int:
        return self._count("held")

    def wait_held(self, count: int = 1, within_s: float = HELD_TIMEOUT_S) -> None:
        """Block until `count` generations are held; fail if one ended before its hold."""
        deadline = time.monotonic() + within_s
        while not self._reached(count):
            assert time.monotonic() < deadline, f"no generation held by {self.key} within {within_s} s"
            time.sleep(POLL_S)

    async def until_held(self, count: int = 1, within_s: float = HELD_TIMEOUT_S) -> None:
        """`wait_held` for async tests (it never blocks the test's event loop)."""
        deadline = time.monotonic() + within_s
        while not self._reached(count):
            assert time.monotonic() < deadline, f"no generation held by {self.key} within {within_s} s"
            await asyncio.sleep(POLL_S)

    def release(self) -> None:
        """Let every generation of this rule run on, now and later; safe to call twice."""
        (self.folder / f"{self.key}.open").touch()
        (self.folder / f"{self.key}.hold").unlink(missing_ok=True)

    def _reached(self, count: int) -> bool:
        early = self._count("early")
        assert not early, f"a generation held by {self.key} ended before its hold: make it longer"
        return self.held_count() >= count

    def _count(self, kind: str) -> int:
        path = self.folder / f"{self.key}.{kind}"
        return len(path.read_text().splitlines()) if path.exists() else 0


class Gate:
    """The test's side of a control folder: closes rules, releases them (all of them at the end)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._holds: list[Hold] = []

    @contextlib.contextmanager
    def hold(self, after: int = 1, *, freeze_engine: bool = False) -> Iterator[Hold]:
        """A closed rule for the block: generations with its key in their prompt are held after
        `after` deltas (0: before the engine sees them); leaving the block releases them."""
        held = self.close(after, freeze_engine=freeze_engine)
        try:
            yield held
        finally:
            held.release()

    def close(self, after: int = 1, *, freeze_engine: bool = False) -> Hold:
        """`hold` without a block: the caller (or `release_all`) releases it."""
        assert after >= 0
        held = Hold(self.folder, f"gate{uuid.uuid4().hex[:12]}")
        spec = json.dumps({"after": after, "freeze_engine": freeze_engine})
        staging = self.folder / f"{held.key}.tmp"
        staging.write_text(spec)
        staging.rename(self.folder / f"{held.key}.hold")  # atomic: the engine never reads half
        self._holds.append(held)
        return held

    def release_all(self) -> None:
        """Teardown: nothing this gate closed stays held (a failed test must not hang the session)."""
        for held in self._holds:
            held.release()
        self._holds.clear()
