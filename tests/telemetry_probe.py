"""Run as `python -m tests.telemetry_probe`: the whole HTTP app (on the scripted engine, in
uvicorn on loopback) serves one traced POST, then prints as JSON what that cost the process in
OpenTelemetry terms: the modules it imported and the threads it runs. tests/test_telemetry_off.py
runs it with and without OTEL_EXPORTER_OTLP_ENDPOINT; the variable reaches it as it reaches a
deployed server, through the environment."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import httpx
import uvicorn

from shared.http.api import create_app
from shared.settings import Settings
from tests.conftest import free_port
from tests.scripted import ScriptedEngine

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def main() -> dict[str, object]:
    app = create_app(Settings(), engine=ScriptedEngine(auto=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        answer = await client.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
    found = {
        "status": answer.status_code,
        "modules": sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry"),
        "threads": sorted(thread.name for thread in threading.enumerate()),
    }
    server.should_exit = True
    await serving
    return found


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
