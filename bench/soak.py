"""`python -m bench.soak`: minutes of churn against a real server, then a leak check.

Workers loop over a seeded mix of what real clients do to a server: finish streams, drop them
with and without an X-Request-Id, resume them with Last-Event-ID (checking that no event is
missing or repeated), cancel them, leave non-streaming requests, send duplicate ids at once and
bad input. At the end (after the disconnect grace) it reports the operations, every 5xx, the
generations still running in the engine and in the bundle, the requests held, and the memory
(RSS) of the API and engine processes before and after. Loopback only, bounded in time and count.

Exit code 0 when there was no 5xx, no broken resume and nothing leaked; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.servers import bundle_command, free_port, running_server

GRACE_S = 2.0  # the server's disconnect grace for this run: dropped named streams end quickly
MAX_TOKENS = 48
BAD_BODIES: list[bytes] = [
    b"{",
    b'{"model": "tiny", "messages": []}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
    b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
]


OPERATIONS = [
    "stream",
    "drop_anonymous",
    "drop_and_resume",
    "cancel",
    "whole",
    "leave_whole",
    "duplicate",
    "bad",
]


@dataclass
class Tally:
    operations: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    broken_resumes: list[str] = field(default_factory=list)
    client_errors: Counter[str] = field(default_factory=Counter)

    def status(self, op: str, response: httpx.Response) -> None:
        self.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.server_errors.append(f"{op}: {response.status_code} {response.text[:200]}")


def _chat(stream: bool, salt: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"soak {salt}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _events(raw: str) -> list[tuple[int, str]]:
    out = []
    for block in raw.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "id" in fields and "data" in fields:
            out.append((int(fields["id"]), fields["data"]))
    return out


class Churn:
    def __init__(self, client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
        self.client, self.tally, self.rng = client, tally, rng
        self.counter = 0

    def _id(self) -> str:
        self.counter += 1
        return f"soak-{id(self):x}-{self.counter}"

    async def one(self) -> None:
        op = self.rng.choice(OPERATIONS)
        self.tally.operations[op] += 1
        await getattr(self, op)()

    async def stream(self) -> None:
        response = await self.client.post("/v1/chat/completions", json=_chat(True, self.counter))
        self.tally.status("stream", response)

    async def _read_some(self, body: dict[str, Any], headers: dict[str, str], events: int) -> str:
        text = ""
        async with self.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            self.tally.status("stream", response)
            async for chunk in response.aiter_text():
                text += chunk
                if text.count("\n\n") >= events:
                    break
        return text

    async def drop_anonymous(self) -> None:
        await self._read_some(_chat(True, self.counter, 400), {}, self.rng.randint(1, 5))

    async def drop_and_resume(self) -> None:
        body, headers = _chat(True, self.counter), {"X-Request-Id": self._id()}
        first = _events(await self._read_some(body, headers, self.rng.randint(1, 6)))
        last = first[-1][0] if first else 0
        resumed = await self.client.post(
            "/v1/chat/completions", json=body, headers={**headers, "Last-Event-ID": str(last)}
        )
        self.tally.status("resume", resumed)
        rest = _events(resumed.text)
        ids = [i for i, _ in first] + [i for i, _ in rest]
        if ids != list(range(1, len(ids) + 1)) or not rest or rest[-1][1] != "[DONE]":
            self.tally.broken_resumes.append(f"{headers['X-Request-Id']}: ids {ids[:3]}..{ids[-3:]}")

    async def cancel(self) -> None:
        request_id = self._id()
        await self._read_some(_chat(True, self.counter, 400), {"X-Request-Id": request_id}, 2)
        response = await self.client.post(f"/v1/requests/{request_id}/cancel")
        self.tally.status("cancel", response)

    async def whole(self) -> None:
        response = await self.client.post("/v1/chat/completions", json=_chat(False, self.counter))
        self.tally.status("whole", response)

    async def leave_whole(self) -> None:
        headers = {"X-Request-Id": self._id()} if self.rng.random() < 0.5 else {}
        with contextlib.suppress(httpx.TimeoutException):  # the point: the client leaves early
            await self.client.post(
                "/v1/chat/completions", json=_chat(False, self.counter, 400), headers=headers, timeout=0.2
            )

    async def duplicate(self) -> None:
        body, headers = _chat(True, self.counter), {"X-Request-Id": self._id()}
        replies = await asyncio.gather(
            *(self.client.post("/v1/chat/completions", json=body, headers=headers) for _ in range(3))
        )
        for reply in replies:
            self.tally.status("duplicate", reply)
        if len({reply.content for reply in replies}) != 1:
            self.tally.broken_resumes.append(f"{headers['X-Request-Id']}: duplicates differ")

    async def bad(self) -> None:
        response = await self.client.post(
            "/v1/chat/completions",
            content=self.rng.choice(BAD_BODIES),
            headers={"Content-Type": "application/json"},
        )
        self.tally.status("bad", response)
        if not 400 <= response.status_code < 500:
            self.tally.server_errors.append(f"bad input got {response.status_code}")


async def churn(url: str, seconds: float, workers: int, max_operations: int, seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=workers * 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker(index: int) -> None:
            churner = Churn(client, tally, random.Random(seed * 1000 + index))
            while time.monotonic() < deadline and sum(tally.operations.values()) < max_operations:
                try:
                    await churner.one()
                except httpx.HTTPError as exc:
                    tally.client_errors[type(exc).__name__] += 1

        await asyncio.gather(*(worker(i) for i in range(workers)))
    return tally


def _rss_mib(pid: int) -> dict[str, float]:
    server = psutil.Process(pid)
    out = {"api": server.memory_info().rss / 2**20}
    for child in server.children(recursive=True):
        try:
            name = child.name()
            if "EngineCore" in name or "EngineCore" in " ".join(child.cmdline()):
                out["engine_core"] = child.memory_info().rss / 2**20
            elif "Worker" in name:
                out["engine_worker"] = child.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return out


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    names = [
        "bundle_engine_running_requests",
        "bundle_running_generations",
        "bundle_active_streams",
        "bundle_held_requests",
    ]
    found = {}
    for name in names:
        match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    env = {
        **os.environ,
        "BUNDLE_DISCONNECT_GRACE_S": str(GRACE_S),
        "BUNDLE_RETENTION_S": "30",
        "BUNDLE_LOG_LEVEL": "warning",
    }
    log = Path(args.log)
    with running_server(bundle_command(port), port, log, env) as pid:
        url = f"http://127.0.0.1:{port}"
        httpx.post(f"{url}/v1/chat/completions", json=_chat(False, 0), timeout=60)  # warm
        before = _rss_mib(pid)
        started = time.monotonic()
        tally = asyncio.run(churn(url, args.seconds, args.workers, args.max_operations, args.seed))
        elapsed = time.monotonic() - started
        time.sleep(GRACE_S + 2)  # dropped named generations end when their grace expires
        after_gauges = _gauges(url)
        after = _rss_mib(pid)
    leaked = after_gauges["bundle_engine_running_requests"] + after_gauges["bundle_running_generations"]
    return {
        "seconds": round(elapsed, 1),
        "workers": args.workers,
        "operations": sum(tally.operations.values()),
        "by_operation": dict(tally.operations),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "server_errors_5xx": len(tally.server_errors),
        "server_error_samples": tally.server_errors[:5],
        "broken_resumes": tally.broken_resumes[:5],
        "client_errors": dict(tally.client_errors),
        "gauges_at_end": after_gauges,
        "leaked_generations": leaked,
        "rss_mib_before": {k: round(v, 1) for k, v in before.items()},
        "rss_mib_after": {k: round(v, 1) for k, v in after.items()},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0, help="churn duration (default 300)")
    p.add_argument("--workers", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--max-operations", type=int, default=100_000, help="stop after this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/cpu/soak.json", help="where the JSON summary goes")
    p.add_argument("--log", default="results/cpu/soak-server.log", help="the server's log")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.seconds <= 0 or args.workers < 1 or args.max_operations < 1:
        print("soak: --seconds, --workers and --max-operations must be positive", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    summary = run(args)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    failed = summary["server_errors_5xx"] or summary["broken_resumes"] or summary["leaked_generations"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
