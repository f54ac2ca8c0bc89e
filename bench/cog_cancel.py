"""Hostile cancels against the real Cog server, for figures (tests/test_cog_cancel.py proves the
same with holds, in `make test`):

    python -m bench.cog_cancel --out results/cpu/cog-cancel.json [--rounds 10 --at-once 20]

coglet serving cog/predict.py:Runner (no holds) with `at-once` slots; each round sends `at-once`
`PUT /predictions/<id>` with `Prefer: respond-async` (max_tokens 2000) and, as soon as each is
answered, `POST /predictions/<id>/cancel`. Per round: the answers, each prediction's final status
(from coglet's webhook), how many predictions ran to their end anyway (coglet's "Prediction
worker completed": its worker finished without a cancel), how many cancels coglet's worker
dropped before the runner (its "Cancel called on idle/unknown slot" lines), and the seconds from
the last cancel's answer until vLLM's own running count (the runner's stats file, rewritten every
50 ms, with the time of each count) reads 0, and its count 1 s after. The next round starts once
the engine is idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from aiohttp import web

from bench.cog_rehearsal import ROOT, RUNNER, _stop_group, python_on_path, wait_setup
from bench.servers import free_port

MAX_TOKENS = 2000
PROMPT = "tell me a long story"
IDLE_POLL_S = 0.01
ROUND_LIMIT_S = 120.0
DROPPED = ("Cancel called on idle slot", "Cancel called on unknown slot")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cog_cancel", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON report")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--at-once", type=int, default=20, help="predictions per round (and coglet slots)")
    p.add_argument("--setup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.rounds < 1 or not 1 <= args.at_once <= 32:
        p.error("--rounds must be >= 1 and --at-once 1..32 (the runner's @cog.concurrent(max=32))")
    return args


class Outcomes:
    """Coglet's webhooks: each prediction's terminal payload, by id."""

    def __init__(self) -> None:
        self.final: dict[str, dict[str, Any]] = {}

    async def receive(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.final[str(payload["id"])] = payload
        return web.Response(text="ok")


async def _serve_webhooks(outcomes: Outcomes) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/hook", outcomes.receive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/hook"


def engine_running(stats: Path) -> tuple[int, float]:
    """vLLM's running count as the runner last wrote it, and when (its time.time())."""
    try:
        snapshot = orjson.loads(stats.read_bytes())
        return int(snapshot["engine_running_requests"]), float(snapshot["time"])
    except (OSError, ValueError, KeyError):
        return -1, 0.0  # not written yet, or mid-rewrite


async def put_then_cancel(client: httpx.AsyncClient, prediction: str, hook: str) -> tuple[int, int]:
    body = {
        "input": {"prompt": PROMPT, "max_tokens": MAX_TOKENS},
        "webhook": hook,
        "webhook_events_filter": ["completed"],
    }
    put = await client.put(f"/predictions/{prediction}", headers={"Prefer": "respond-async"}, json=body)
    while put.status_code == 409:  # a slot of the round before is not free again yet
        await asyncio.sleep(0.05)
        put = await client.put(f"/predictions/{prediction}", headers={"Prefer": "respond-async"}, json=body)
    cancel = await client.post(f"/predictions/{prediction}/cancel")
    return put.status_code, cancel.status_code


async def one_round(
    client: httpx.AsyncClient, outcomes: Outcomes, hook: str, stats: Path, log: Path, name: str, at_once: int
) -> dict[str, Any]:
    predictions = [f"{name}-{index}" for index in range(at_once)]
    dropped_before = _count(log, DROPPED)
    answers = await asyncio.gather(*(put_then_cancel(client, p, hook) for p in predictions))
    last_cancel = time.time()
    idle_after: float | None = None
    running_after_1s: int | None = None
    while time.time() - last_cancel < ROUND_LIMIT_S:
        running, written_at = engine_running(stats)
        since = written_at - last_cancel  # a snapshot from before the last cancel says nothing
        if running_after_1s is None and since >= 1.0:
            running_after_1s = running
        if running == 0 and since >= 0 and idle_after is None:
            idle_after = since
        if idle_after is not None and all(p in outcomes.final for p in predictions):
            break
        await asyncio.sleep(IDLE_POLL_S)
    ran_to_end = _ran_to_end(log, predictions)
    statuses = [outcomes.final.get(p, {}).get("status", "none") for p in predictions]
    return {
        "round": name,
        "answers": sorted({f"{put}/{cancel}" for put, cancel in answers}),
        "statuses": {status: statuses.count(status) for status in sorted(set(statuses))},
        "ran_to_end": len(ran_to_end),
        "ran_to_end_tokens": [
            outcomes.final.get(p, {}).get("metrics", {}).get("output_token_count") for p in ran_to_end
        ],
        "dropped_by_coglet": _count(log, DROPPED) - dropped_before,
        "engine_idle_after_s": None if idle_after is None else round(idle_after, 3),
        "engine_running_1s_after": running_after_1s or 0,
    }


def _ran_to_end(log: Path, predictions: list[str]) -> list[str]:
    """The predictions coglet's worker finished without a cancel (its own log line)."""
    text = log.read_text(errors="replace")
    return [p for p in predictions if f'"Prediction worker completed","prediction_id":"{p}"' in text]


def _count(log: Path, needles: tuple[str, ...]) -> int:
    text = log.read_text(errors="replace")
    return sum(len(re.findall(re.escape(needle), text)) for needle in needles)


async def run_rounds(url: str, stats: Path, log: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    outcomes = Outcomes()
    webhooks, hook = await _serve_webhooks(outcomes)
    rounds = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            for index in range(args.rounds):
                result = await one_round(client, outcomes, hook, stats, log, f"r{index}", args.at_once)
                rounds.append(result)
                print(orjson.dumps(result).decode(), file=sys.stderr, flush=True)
                # A dropped cancel's generation runs to its end; a file to poll, nothing to await.
                while engine_running(stats)[0] != 0:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    finally:
        await webhooks.cleanup()
    return rounds


def summary(rounds: list[dict[str, Any]], at_once: int) -> dict[str, Any]:
    """Totals; `running_1s_after_beyond_ran_to_end` counts generations still in vLLM 1 s after a
    round's last cancel other than those of predictions that ran to their end (0: every one left
    running was one the runner was never told about)."""
    clean = [r for r in rounds if r["dropped_by_coglet"] == 0]
    return {
        "pairs": at_once * len(rounds),
        "ran_to_end": sum(r["ran_to_end"] for r in rounds),
        "dropped_by_coglet": sum(r["dropped_by_coglet"] for r in rounds),
        "rounds_without_drops": len(clean),
        "engine_idle_after_s_max_without_drops": _max_idle(clean),
        "engine_idle_after_s_max": _max_idle(rounds),
        "running_1s_after_beyond_ran_to_end": sum(
            max(0, r["engine_running_1s_after"] - r["ran_to_end"]) for r in rounds
        ),
    }


def _max_idle(rounds: list[dict[str, Any]]) -> float | None:
    """The slowest round's seconds to an idle engine; None if one never got idle in time."""
    idle = [r["engine_idle_after_s"] for r in rounds]
    return None if not idle or None in idle else max(idle)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="cog-cancel-") as scratch:
        work = Path(scratch)
        port, log, stats = free_port(), work / "coglet.log", work / "engine-stats.json"
        process = launch_coglet(work, port, log, stats, args.at_once)
        try:
            url = f"http://127.0.0.1:{port}"
            status, seconds, _ = wait_setup(url, process, args.setup_timeout)
            if status != "READY":
                print(f"coglet did not get ready ({status} after {seconds:.0f} s); log:", file=sys.stderr)
                print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
                return 1
            rounds = asyncio.run(run_rounds(url, stats, log, args))
        finally:
            _stop_group(process)
    report = {
        "at_once": args.at_once,
        "max_tokens": MAX_TOKENS,
        "rounds": rounds,
        "summary": summary(rounds, args.at_once),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    print(orjson.dumps(report["summary"]).decode())
    return 0


def launch_coglet(work: Path, port: int, log: Path, stats: Path, slots: int) -> subprocess.Popen[bytes]:
    """coglet serving the real runner, its worker's cancel handling in the log (trace)."""
    env = {
        **os.environ,
        **python_on_path(work / "bin"),
        "COG_PREDICT_TYPE_STUB": RUNNER,
        "COG_MAX_CONCURRENCY": str(slots),
        "PORT": str(port),
        "BUNDLE_ENGINE_STATS_FILE": str(stats),
        "BUNDLE_MAX_MODEL_LEN": "2048",
        "RUST_LOG": "info,coglet::worker_bridge=trace,coglet::cancel=trace",
    }
    with log.open("wb") as out:
        # Its own process group (the worker and vLLM's engine die with it), not its own session.
        return subprocess.Popen(
            [sys.executable, "-m", "cog.server.http", "--host", "127.0.0.1"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )


if __name__ == "__main__":
    raise SystemExit(main())
