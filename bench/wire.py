"""`python -m bench.wire record FILE` / `python -m bench.wire compare OLD NEW`: what the API puts on
the wire, byte for byte, for a fixed set of requests (the README's curl example, streams with
and without SSE ids, a resume, errors), so that a refactor can show it changed nothing a client
sees. Record on the commit before, record on the commit after, compare.

The server is `python -m shared.serve` with the tiny model on a free port. Only what differs
between two identical runs by design is normalised: generated ids, `created` timestamps, the
`date` header. Everything else (status, every other header, every body byte, event framing) is
compared as sent.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.servers import bundle_command, free_port, running_server

README_CHAT = {
    "model": "tiny",
    "stream": True,
    "max_tokens": 40,
    "messages": [{"role": "user", "content": "Hello!"}],
}
GREEDY_CHAT = {
    "model": "tiny",
    "max_tokens": 24,
    "temperature": 0,
    "messages": [{"role": "user", "content": "Hi"}],
}
GREEDY_COMPLETION = {"model": "tiny", "prompt": "Once upon", "max_tokens": 16, "temperature": 0, "stream": True}
SSE = {"Accept": "text/event-stream"}

# (name, method, path, headers, body: a JSON object, raw bytes, or None)
CASES: list[tuple[str, str, str, dict[str, str], Any]] = [
    ("readme-chat-stream", "POST", "/v1/chat/completions", {}, README_CHAT),
    ("chat-greedy", "POST", "/v1/chat/completions", {}, GREEDY_CHAT),
    (
        "chat-greedy-stream-sse-ids",
        "POST",
        "/v1/chat/completions",
        {**SSE, "X-Request-Id": "wire-1"},
        {**GREEDY_CHAT, "stream": True},
    ),
    (
        "chat-resume-after-3",
        "POST",
        "/v1/chat/completions",
        {**SSE, "X-Request-Id": "wire-1", "Last-Event-ID": "3"},
        {**GREEDY_CHAT, "stream": True},
    ),
    (
        "chat-same-id-other-body",
        "POST",
        "/v1/chat/completions",
        {"X-Request-Id": "wire-1"},
        {**GREEDY_CHAT, "max_tokens": 5},
    ),
    ("completion-greedy-stream", "POST", "/v1/completions", {}, GREEDY_COMPLETION),
    ("models", "GET", "/v1/models", {}, None),
    ("health", "GET", "/health", {}, None),
    ("bad-json", "POST", "/v1/chat/completions", {"Content-Type": "application/json"}, b"{not json"),
    ("unknown-model", "POST", "/v1/chat/completions", {}, {**GREEDY_CHAT, "model": "nope"}),
    ("no-messages", "POST", "/v1/chat/completions", {}, {"model": "tiny"}),
    ("max-tokens-too-big", "POST", "/v1/chat/completions", {}, {**GREEDY_CHAT, "max_tokens": 10**9}),
    ("unknown-path", "GET", "/v1/nothing", {}, None),
    ("wrong-method", "GET", "/v1/chat/completions", {}, None),
]

_VOLATILE = [
    (re.compile(rb'"(id|response_id)":\s*"(chatcmpl|cmpl|req|resp)-[^"]*"'), rb'"\1":"\2-ID"'),
    (re.compile(rb'"created":\s*\d+'), rb'"created":0'),
    (re.compile(rb'"created_at":\s*[\d.]+'), rb'"created_at":0'),
]
_SKIPPED_HEADERS = {"date"}


def normalise(body: bytes) -> bytes:
    for pattern, replacement in _VOLATILE:
        body = pattern.sub(replacement, body)
    return body


def exchange(client: httpx.Client, case: tuple[str, str, str, dict[str, str], Any]) -> dict[str, Any]:
    name, method, path, headers, body = case
    content = body if isinstance(body, bytes) else (orjson.dumps(body) if body is not None else None)
    if content is not None and not isinstance(body, bytes):
        headers = {"Content-Type": "application/json", **headers}
    response = client.request(method, path, headers=headers, content=content)
    kept = [[k, v] for k, v in response.headers.multi_items() if k.lower() not in _SKIPPED_HEADERS]
    if "X-Request-Id" not in headers:  # an id the server made up differs from run to run
        kept = [[k, "GENERATED" if k.lower() == "x-request-id" else v] for k, v in kept]
    text = normalise(response.content).decode("utf-8", "replace")
    return {"name": name, "status": response.status_code, "headers": kept, "body": text}


def record(out: Path) -> None:
    port = free_port()
    env = {**os.environ, "BUNDLE_MODEL": "tiny", "BUNDLE_PORT": str(port)}
    with (
        tempfile.TemporaryDirectory() as work,
        running_server(bundle_command(port), port, Path(work) / "server.log", env),
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client,
    ):
        exchanges = [exchange(client, case) for case in CASES]
    recording = {"schema": "bundle-wire/1", "exchanges": exchanges}
    out.write_bytes(orjson.dumps(recording, option=orjson.OPT_INDENT_2))
    print(f"wrote {len(exchanges)} exchanges to {out}")


def compare(old: Path, new: Path) -> int:
    before = {e["name"]: e for e in orjson.loads(old.read_bytes())["exchanges"]}
    after = {e["name"]: e for e in orjson.loads(new.read_bytes())["exchanges"]}
    differing = [name for name in before.keys() | after.keys() if before.get(name) != after.get(name)]
    for name in sorted(differing):
        print(f"differs: {name}\n  before: {before.get(name)}\n  after:  {after.get(name)}")
    print(f"{len(before)} exchanges, {len(differing)} differ")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wire", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("record", help="run the requests against a fresh server").add_argument("out", type=Path)
    compare_parser = commands.add_parser("compare", help="exit 1 if two recordings differ")
    compare_parser.add_argument("old", type=Path)
    compare_parser.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.out)
        return 0
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
