"""Named example inputs. `seed` is the calculation this product started from."""

from __future__ import annotations

from typing import Any

SEED_SECONDS = 2.1
SEED_USD_PER_SECOND = 0.0006
SEED_USD_PER_REQUEST = 0.0008

# Defaults filled in for flags the user did not give. The throughput curve is illustrative
# (it reproduces the seed's 2.1 s at one stream); pass --bench for measured numbers.
SCENARIOS: dict[str, dict[str, Any]] = {
    "seed": {
        "requests_per_day": 1000.0,
        "arrival": "poisson",
        "prompt_tokens": 100,
        "output_tokens": 1000,
        "throughput": "1:500,8:400,32:250",
        "ttft": 0.1,
        "cold_start": 30.0,
        "gpu": "A100-80GB",
        "concurrency": 8,
        "price_per_request": SEED_USD_PER_REQUEST,
    },
}


def seed_notes() -> list[str]:
    naive = SEED_SECONDS * SEED_USD_PER_SECOND
    return [
        "Seed example (naive): one 1,000-token Llama-3-8B request takes "
        f"{SEED_SECONDS} s; {SEED_SECONDS} s x ${SEED_USD_PER_SECOND}/s = ${naive:.5f}/request, "
        f"against a per-request price of ${SEED_USD_PER_REQUEST}.",
        "That ignores cold starts, idle time inside the scale-down window, minimum containers, "
        "peak replicas and streams sharing a GPU. The honest figures for the same request at "
        "1,000 requests/day (Poisson) follow; the throughput curve is illustrative (2.1 s at 1 stream).",
    ]


def scenario(name: str | None) -> dict[str, Any]:
    return dict(SCENARIOS.get(name or "", {}))


def notes_for(name: str | None) -> list[str]:
    return seed_notes() if name == "seed" else []
