"""Cog cancels under the real coglet 0.23.1, the real runner and the real CPU engine: every window
of cog/cog_cancel.py made deterministic by a hold (tests/cog_hold_runner.py), then a hostile loop.

One server for the module, 20 slots, the runner with holds; every generation a test starts is
held in the engine (budget 0: vLLM holds the request, none of its outputs passes), so one that
a cancel failed to end stays there for the test to see, instead of ending on its own and hiding
the fault. Coglet's worker logs how it handled each cancel (RUST_LOG, coglet::worker_bridge).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .cog_server import (
    HOLD_RUNNER_REF,
    CogServer,
    Holds,
    Stream,
    Webhooks,
    put_async,
    running_cog_server,
    sse_prediction,
    until,
    webhook_receiver,
)

AT_ONCE = 20
# 10 rounds: the 200 PUT+cancel pairs (BUNDLE_TEST_HOSTILE_ROUNDS for more or fewer).
HOSTILE_ROUNDS = int(os.environ.get("BUNDLE_TEST_HOSTILE_ROUNDS", "10"))
INPUTS = {"prompt": "tell me a long story", "max_tokens": 256, "temperature": 1.0}
WITHIN_S = 60.0  # bounds for things that take well under a second on an idle machine
# What coglet's worker logs for each `Cancel` it gets (coglet-python/src/worker_bridge.rs and
# cancel.rs): the slot was idle or unknown (the cancel is dropped), or the future was cancelled
# (or failed to be), or the exception was injected into the slot thread (or failed to be).
DROPPED = ("Cancel called on idle slot", "Cancel called on unknown slot")
# An injected cancel may be lost too (docs/cog.md, "Cancel"): coglet logs it as injected, yet the
# exception never surfaces in the slot thread, and coglet stores run()'s future afterwards as if
# nothing was cancelled (each injection inspected in the hostile loop's logs was lost).
INJECTED = ("Injected CancelationException",)
DELIVERED = (
    "Cancelled async future",
    "Failed to cancel async future",
    "Injected CancelationException",
    "PyThreadState_SetAsyncExc",
    # The prediction ended between the worker's two looks at the slot: nothing left to cancel.
    '"No async future to cancel"',
)
# What coglet's orchestrator logs for each `Cancel` it sends to the worker.
SENT = ('"Cancelling prediction"', '"Applying pending cancellation"')


@pytest.fixture(scope="module")
def cancel_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CogServer]:
    with running_cog_server(
        tmp_path_factory.mktemp("cog-cancel"),
        runner=HOLD_RUNNER_REF,
        COG_MAX_CONCURRENCY=str(AT_ONCE),
        RUST_LOG="info,coglet::worker_bridge=trace,coglet::cancel=trace",
        BUNDLE_MAX_MODEL_LEN="2048",
    ) as server:
        yield server


def _cancel(server: CogServer, prediction: str) -> int:
    return httpx.post(f"{server.url}/predictions/{prediction}/cancel", timeout=60).status_code


async def _terminal(hooks: Webhooks, prediction: str) -> dict[str, Any]:
    await until(lambda: hooks.terminal(prediction) is not None, WITHIN_S, f"{prediction} ended")
    payload = hooks.terminal(prediction)
    assert payload is not None
    return payload


async def _held_and_cancelled(
    server: CogServer, prediction: str, point: str, inputs: dict[str, Any]
) -> dict[str, Any]:
    """Send the prediction (respond-async), wait until run() holds at `point`, cancel it, and
    return what coglet finally said about it."""
    holds = server.held
    holds.budget(prediction, 0)
    holds.hold(prediction, point)
    async with webhook_receiver() as hooks, httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        assert await put_async(client, prediction, inputs, hooks) == 202
        await asyncio.to_thread(holds.wait_for, prediction, f"at-{point}", WITHIN_S)
        assert await asyncio.to_thread(_cancel, server, prediction) == 200
        return await _terminal(hooks, prediction)


def _is_cancelled(payload: dict[str, Any]) -> bool:
    """Coglet 0.23.1 says "failed" (CancelationException) for a cancel injected into the slot
    thread before run() was submitted; anything else cancelled is "canceled"."""
    return payload["status"] == "canceled" or (
        payload["status"] == "failed" and "CancelationException" in str(payload.get("error"))
    )


def test_a_cancel_while_coglet_submits_run_starts_nothing(cancel_server: CogServer) -> None:
    """Window 2 of cog/cog_cancel.py: coglet injects CancelationException into the slot thread
    between submitting run() and waiting on it. run() was never started, so nothing reached the
    engine (it used to be submitted already and run its generation to the end, unread)."""
    holds, prediction = cancel_server.held, "window-submit"
    payload = asyncio.run(_held_and_cancelled(cancel_server, prediction, "submit", INPUTS))
    assert holds.marker(prediction, "interrupted") == "CancelationException"
    assert _is_cancelled(payload), payload
    probe_after(cancel_server)
    assert holds.marker(prediction, "generating") is None
    print(f"\ncoglet said {payload['status']!r}: {payload.get('error')}")


def test_a_cancel_while_run_opens_its_generation_aborts_it(cancel_server: CogServer) -> None:
    """Cancelled at an await inside the service's `open`, the generation (named: a request_id,
    so it used to get the disconnect grace window, or be lost with its reader) is aborted."""
    holds, prediction = cancel_server.held, "window-open"
    inputs = {**INPUTS, "request_id": "window-open-id"}
    payload = asyncio.run(_held_and_cancelled(cancel_server, prediction, "open", inputs))
    assert payload["status"] == "canceled", payload
    assert holds.wait_for(prediction, "ended", WITHIN_S) == "aborted"
    assert holds.marker(prediction, "left-open") is not None  # the open ran to its end first


def test_a_cancel_as_run_returns_its_generator_aborts_it(cancel_server: CogServer) -> None:
    """Window 3: run() returns its generator after coglet cancelled it (the loop reached the
    return before the cancel). Nobody reads that generator; its generation is aborted anyway."""
    holds, prediction = cancel_server.held, "window-return"
    payload = asyncio.run(_held_and_cancelled(cancel_server, prediction, "return", INPUTS))
    assert payload["status"] == "canceled", payload
    assert holds.wait_for(prediction, "ended", WITHIN_S) == "aborted"
    assert holds.marker(prediction, "left-return") is not None


def test_a_follower_cancelled_while_attaching_leaves_the_generation_to_its_owner(
    cancel_server: CogServer,
) -> None:
    """Two predictions with one request_id read one generation. The second is cancelled while it
    attaches: the owner's generation goes on; cancelled next, the owner was its last reader, so
    the generation is aborted (a follower lost half-way used to keep it running for nobody)."""
    holds = cancel_server.held
    owner, follower = "attach-owner", "attach-follower"
    inputs = {**INPUTS, "request_id": "attach-shared-id"}
    holds.budget(owner, 1)

    async def go() -> tuple[Stream, dict[str, Any], str | None, int]:
        async with httpx.AsyncClient(timeout=120) as client:
            stream = Stream()
            owning = asyncio.create_task(
                sse_prediction(client, cancel_server.url, inputs, time.monotonic(), owner, stream)
            )
            await asyncio.wait_for(stream.first_chunk.wait(), WITHIN_S)
            followed = await _held_and_cancelled(cancel_server, follower, "open", inputs)
            await asyncio.to_thread(probe_after, cancel_server)
            owner_after_follower = holds.marker(owner, "ended")
            cancelled = await asyncio.to_thread(_cancel, cancel_server, owner)
            return await owning, followed, owner_after_follower, cancelled

    stream, followed, owner_after_follower, owner_cancel = asyncio.run(go())
    assert followed["status"] == "canceled", followed
    assert holds.marker(follower, "generating") is None  # it joined the owner's generation
    assert owner_after_follower is None, "the follower's cancel aborted the owner's generation"
    assert owner_cancel == 200
    assert stream.completed is not None and stream.completed["status"] == "canceled"
    assert holds.wait_for(owner, "ended", WITHIN_S) == "aborted"


def probe_after(server: CogServer) -> None:
    """A one-token prediction: coglet dispatches it after everything sent before, and the loop
    runs it after what it had queued, so earlier work has settled when it returns."""
    response = httpx.post(
        f"{server.url}/predictions", json={"input": {"prompt": "ping", "max_tokens": 1}}, timeout=60
    )
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text


# --- the hostile loop ---------------------------------------------------------------------------------
def test_hostile_put_and_cancel_at_once_leave_nothing_running(cancel_server: CogServer) -> None:
    """AT_ONCE predictions at once (`Prefer: respond-async`), each cancelled as soon as coglet
    answered its PUT, HOSTILE_ROUNDS times. Every cancel that reached the runner ends its
    engine request; a cancel coglet 0.23.1 loses before the runner (the slot still idle in its
    worker, or the exception injected into its slot thread and never raised: module docstring
    of cog/cog_cancel.py) is counted, checked against coglet's own log, and its prediction
    cancelled again, which then ends it. Nothing is left running."""
    log = CoordinatedLog(cancel_server.log_path)
    report = []
    for round_number in range(HOSTILE_ROUNDS):
        report.append(asyncio.run(_hostile_round(cancel_server, log, f"hostile-{round_number}")))
    for line in report:
        print("\n" + line)
    asyncio.run(until(lambda: cancel_server.engine_running_requests() == 0, WITHIN_S, "vLLM holds nothing"))


async def _hostile_round(server: CogServer, log: CoordinatedLog, name: str) -> str:
    holds = server.held
    predictions = [f"{name}-{index}" for index in range(AT_ONCE)]
    for prediction in predictions:
        holds.budget(prediction, 0)
    async with webhook_receiver() as hooks, httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        answers = await asyncio.gather(*(_put_then_cancel(client, hooks, p) for p in predictions))
        last_cancel = time.time()
        assert all(answer == (202, 200) for answer in answers), answers
        # Coglet answers a cancel before its orchestrator sends it on: first every one is sent,
        # then every one sent is handled by the worker.
        await until(lambda: log.sent_for(predictions), WITHIN_S, "coglet sent every cancel to its worker")
        await until(log.every_cancel_handled, WITHIN_S, "coglet's worker handled every cancel it was sent")
        # A cancel the worker delivered (injected into the slot thread, say) reaches the runner a
        # moment after the worker logged it: until it has, its prediction looks like one whose
        # cancel was dropped. So wait until no more predictions lack an end than cancels dropped.
        def settled() -> bool:
            unended = [p for p in predictions if hooks.terminal(p) is None]
            return all(_settled(holds, hooks, p) for p in predictions) and len(unended) <= log.lost_unseen()

        await until(settled, WITHIN_S, "every cancel the worker delivered ended its prediction")
        dropped = [p for p in predictions if hooks.terminal(p) is None]
        reached = [p for p in predictions if p not in dropped]
        for prediction in reached:  # the runner got the cancel: its generation, if any, is gone
            payload = await _terminal(hooks, prediction)
            assert _is_cancelled(payload), payload
            if holds.marker(prediction, "generating") is not None:
                await until(
                    lambda p=prediction: holds.marker(p, "ended") is not None, WITHIN_S, f"{prediction} left"
                )
                assert holds.marker(prediction, "ended") == "aborted"
        left = [holds.marked_at(p, "ended") - last_cancel for p in reached if holds.marker(p, "ended")]
        dropped_by_coglet, injected_by_coglet = log.lost_since_last_look()
        assert len(dropped) <= dropped_by_coglet + injected_by_coglet, (dropped, dropped_by_coglet)
        for prediction in dropped:  # cancelled again: now the runner has it
            again = await asyncio.to_thread(_cancel, server, prediction)
            # 404: it ended meanwhile, its first cancel reaching the runner after all (the losses
            # counted from coglet's log are an upper bound: coglet applies some dropped cancels
            # again, and not every injection is lost); its webhook must then say "canceled".
            assert again in (200, 404), again
            assert (await _terminal(hooks, prediction))["status"] == "canceled"
            assert holds.wait_for(prediction, "ended", WITHIN_S) == "aborted"
    slowest = max(left, default=0.0)
    assert slowest < WITHIN_S  # the figure that matters (within 1 s) is bench/cog_cancel.py's
    return (
        f"{name}: {AT_ONCE} PUT+cancel; {len(reached)} reached the runner (the last generation "
        f"left {slowest:+.2f} s from the last cancel's answer); {len(dropped)} lost by coglet "
        f"(its worker logged {dropped_by_coglet} dropped and {injected_by_coglet} injected "
        "cancels), each ended by a second cancel"
    )


async def _put_then_cancel(client: httpx.AsyncClient, hooks: Webhooks, prediction: str) -> tuple[int, int]:
    put = await put_async(client, prediction, INPUTS, hooks)
    while put == 409:  # a slot of the round before is not free again yet: nothing was started
        await asyncio.sleep(0.05)
        put = await put_async(client, prediction, INPUTS, hooks)
    cancel = await client.post(f"/predictions/{prediction}/cancel")
    return put, cancel.status_code


def _settled(holds: Holds, hooks: Webhooks, prediction: str) -> bool:
    """Ended for coglet, or held in the engine with no cancel seen by the runner (every cancel
    sent is handled by now, so no cancel is still on its way to it: coglet dropped it)."""
    if hooks.terminal(prediction) is not None:
        return True
    return (
        holds.marker(prediction, "generating") is not None and holds.marker(prediction, "cancel-seen") is None
    )


class CoordinatedLog:
    """Coglet's log, counted: cancels its orchestrator sent, and what its worker did with them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = {DROPPED: 0, INJECTED: 0}

    def _count(self, needles: tuple[str, ...]) -> int:
        text = self.path.read_text(errors="replace")
        return sum(len(re.findall(re.escape(needle), text)) for needle in needles)

    def sent_for(self, predictions: list[str]) -> bool:
        """Whether the orchestrator sent a cancel to the worker for each of `predictions`."""
        text = self.path.read_text(errors="replace")
        return all(any(f'{sent},"prediction_id":"{p}"' in text for sent in SENT) for p in predictions)

    def every_cancel_handled(self) -> bool:
        return self._count(SENT) == self._count(DROPPED) + self._count(DELIVERED)

    def lost_unseen(self) -> int:
        """Cancels the worker dropped or injected (either may be lost) since the last look."""
        return sum(self._count(needles) - seen for needles, seen in self._seen.items())

    def lost_since_last_look(self) -> tuple[int, int]:
        """Cancels dropped, and cancels injected, since the last call."""
        totals = {needles: self._count(needles) for needles in self._seen}
        lost = tuple(totals[needles] - self._seen[needles] for needles in (DROPPED, INJECTED))
        self._seen = totals
        return lost[0], lost[1]
