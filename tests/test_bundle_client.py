"""The resuming client is a product of its own: it imports and works without the server's stack.

A fresh interpreter blocks vLLM, FastAPI, Starlette, uvicorn, redis, torch and the `shared` core
(`sys.modules[name] = None` makes every import of them fail), then streams a chat completion from
a stdlib HTTP server whose first connection breaks after two numbered events: the client must
resume with `Last-Event-ID` and yield every piece exactly once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("vllm", "fastapi", "starlette", "uvicorn", "redis", "torch", "shared")

SCRIPT = textwrap.dedent(
    """
    import sys
    for name in {blocked!r}:
        sys.modules[name] = None  # any import of it now raises ImportError

    import asyncio, json, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bundle_client.client import ResumableClient

    PIECES = ["one ", "two ", "three ", "four"]
    seen = []  # (X-Request-Id, Last-Event-ID) of every connection

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            last = self.headers.get("Last-Event-ID")
            seen.append((self.headers["X-Request-Id"], last))
            start = 0 if last is None else int(last) + 1
            stop = 2 if last is None else len(PIECES)  # the first connection breaks after two
            body = b"".join(
                b"id: %d\\ndata: %s\\n\\n" % (i, json.dumps(
                    {{"choices": [{{"index": 0, "delta": {{"content": PIECES[i]}}}}]}}).encode())
                for i in range(start, stop))
            if stop == len(PIECES):
                body += b"data: [DONE]\\n\\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body) + (0 if stop == len(PIECES) else 50)))
            self.end_headers()
            self.wfile.write(body)  # short of its Content-Length when broken: a cut connection
            self.close_connection = True

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def main():
        base = "http://127.0.0.1:%d" % server.server_address[1]
        async with ResumableClient(base, backoff_s=0.01) as client:
            pieces = [p async for p in client.stream_chat([{{"role": "user", "content": "hi"}}])]
            return pieces, client.reconnects

    pieces, reconnects = asyncio.run(main())
    server.shutdown()
    assert not any(sys.modules.get(name) for name in {blocked!r}), "a blocked module was imported"
    print(json.dumps({{"pieces": pieces, "reconnects": reconnects, "seen": seen}}))
    """
).format(blocked=BLOCKED)


def test_client_streams_and_resumes_without_the_server_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = __import__("json").loads(done.stdout)
    assert result["pieces"] == ["one ", "two ", "three ", "four"]
    assert result["reconnects"] == 1
    (first_id, first_last), (second_id, second_last) = result["seen"]
    assert first_id == second_id and first_last is None and second_last == "1"


def test_blocking_works() -> None:
    """The block above is real: with the server's stack blocked (the core itself left importable),
    the server's app cannot be imported."""
    stack = tuple(name for name in BLOCKED if name != "shared")
    code = f"import sys\nfor n in {stack!r}: sys.modules[n] = None\nimport shared.http.api\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "import of fastapi halted" in done.stderr, done.stderr
