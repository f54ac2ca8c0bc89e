"""The deploy smoke test behind `modal run modal_app/app.py`: is it up, and how fast does it stream?

It runs on the caller's machine against a base URL (a Modal endpoint, or a local server in the
tests), so it uses only the core's resumable client and httpx: no Modal, no vLLM.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bundle_client.client import ResumableClient
from modal_app.settings import ModalSettings
from shared.settings import Settings

SMOKE_PROMPT = "In three sentences, why does continuous batching make GPU inference cheaper?"


@dataclass(frozen=True)
class SmokeResult:
    text: str
    time_to_first_token_s: float
    completion_tokens: int
    total_s: float
    reconnects: int

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first one, over the time after the first one."""
        decode_s = self.total_s - self.time_to_first_token_s
        return (self.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0

    def summary(self) -> str:
        return (
            f"time to first token {self.time_to_first_token_s:.3f} s, "
            f"{self.completion_tokens} tokens in {self.total_s:.2f} s "
            f"({self.tokens_per_s:.1f} tokens/s after the first), "
            f"{self.reconnects} reconnects"
        )


def auth_headers(settings: Settings, modal_settings: ModalSettings) -> dict[str, str]:
    """The bundle's bearer key, plus Modal's proxy-auth pair when the endpoint requires it."""
    headers: dict[str, str] = {}
    if settings.api_key is not None:
        headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
    if modal_settings.requires_proxy_auth:
        if modal_settings.proxy_key is None or modal_settings.proxy_secret is None:
            raise ValueError(
                "the endpoint requires Modal proxy auth: set BUNDLE_MODAL_PROXY_KEY and "
                "BUNDLE_MODAL_PROXY_SECRET to a proxy auth token (modal.com > Settings)"
            )
        headers["Modal-Key"] = modal_settings.proxy_key
        headers["Modal-Secret"] = modal_settings.proxy_secret.get_secret_value()
    return headers


async def wait_healthy(http: httpx.AsyncClient, timeout_s: float) -> None:
    """Poll GET /health until 200. A scaled-to-zero app cold-starts on this very request."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = await http.get("/health")
            if response.status_code == 200:
                return
            reason = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.TransportError as exc:
            reason = repr(exc)
        if time.monotonic() > deadline:
            raise TimeoutError(f"/health did not answer 200 within {timeout_s:.0f} s ({reason})")
        await asyncio.sleep(2.0)


async def run_smoke(
    base_url: str,
    settings: Settings,
    modal_settings: ModalSettings | None = None,
    *,
    prompt: str = SMOKE_PROMPT,
    max_tokens: int = 128,
    health_timeout_s: float | None = None,
) -> SmokeResult:
    """Check /health, then stream one chat completion and time it."""
    # Redirects are followed: past Modal's 150 s web limit a waiting request gets a 303 to its
    # result URL (a cold start that downloads weights can take that long on /health).
    modal_settings = modal_settings or ModalSettings()
    timeout = httpx.Timeout(30.0, read=float(modal_settings.startup_timeout_s))
    headers = auth_headers(settings, modal_settings)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, follow_redirects=True
    ) as http:
        await wait_healthy(http, health_timeout_s or modal_settings.startup_timeout_s)
        async with ResumableClient(base_url, http=http) as client:
            return await _timed_stream(client, settings.model_name, prompt, max_tokens)


async def _timed_stream(client: ResumableClient, model: str, prompt: str, max_tokens: int) -> SmokeResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first_token_at: float | None = None
    pieces: list[str] = []
    usage_tokens: int | None = None
    async for chunk in client.stream_chunks("/v1/chat/completions", body):
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                first_token_at = first_token_at or time.perf_counter()
                pieces.append(text)
        if chunk.get("usage"):
            usage_tokens = int(chunk["usage"]["completion_tokens"])
    finished = time.perf_counter()
    if first_token_at is None:
        raise RuntimeError("the stream finished without a single token")
    return SmokeResult(
        text="".join(pieces),
        time_to_first_token_s=first_token_at - started,
        completion_tokens=usage_tokens if usage_tokens is not None else len(pieces),
        total_s=finished - started,
        reconnects=client.reconnects,
    )
