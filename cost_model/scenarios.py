"""Named example inputs. `seed` is the calculation this product started from, and why it is wrong."""

from __future__ import annotations

from typing import Any

SEED_SECONDS = 2.1
SEED_TOKENS = 1000
SEED_USD_PER_SECOND = 0.0006
SEED_USD_PER_REQUEST = 0.0008
# Upper bound for one decode stream: each token reads every weight once from GPU memory.
A100_80GB_BYTES_PER_S = 2.039e12  # NVIDIA A100 80GB SXM datasheet memory bandwidth
LLAMA3_8B_BF16_BYTES = 8.03e9 * 2  # 8.03 B parameters x 2 bytes

# The corrected estimate: A100 prices from the catalogue and a per-stream speed within the
# bandwidth bound (about 100 tok/s at one stream, falling as streams share the GPU; illustrative).
SCENARIOS: dict[str, dict[str, Any]] = {
    "seed": {
        "requests_per_day": 1000.0,
        "arrival": "poisson",
        "prompt_tokens": 100,
        "output_tokens": SEED_TOKENS,
        "throughput": "1:100,8:90,32:60",
        "ttft": 0.1,
        "cold_start": 30.0,
        "gpu": "A100-80GB",
        "concurrency": 8,
        "price_per_request": SEED_USD_PER_REQUEST,
    },
}


def seed_notes() -> list[str]:
    naive = SEED_SECONDS * SEED_USD_PER_SECOND
    claimed = SEED_TOKENS / (SEED_SECONDS - 0.1)
    bound = A100_80GB_BYTES_PER_S / LLAMA3_8B_BF16_BYTES
    return [
        f"Seed example (naive): a {SEED_TOKENS:,}-token Llama-3-8B request takes {SEED_SECONDS} s; "
        f"{SEED_SECONDS} s x ${SEED_USD_PER_SECOND}/s = ${naive:.5f}/request, "
        f"against ${SEED_USD_PER_REQUEST}/request.",
        f"Why it is wrong: (1) ${SEED_USD_PER_SECOND}/s and ${SEED_USD_PER_REQUEST}/request have no source "
        "(no catalogue page lists them; the catalogue's A100 prices are used below); (2) "
        f"{SEED_TOKENS:,} tokens in {SEED_SECONDS} s is {claimed:.0f} tok/s on one stream, "
        f"{claimed / bound:.1f}x the {bound:.0f} tok/s that an A100 80GB's memory bandwidth allows an 8B bf16 "
        "model (every token reads all 16 GB of weights); (3) it ignores start-ups, idle windows, minimum "
        "containers and streams sharing a GPU.",
        "Corrected estimate (1,000 requests/day, Poisson): catalogue prices; illustrative curve 1:100, 8:90, "
        "32:60 tok/s per stream (within the bound), 30 s start-up; "
        "the $0.0008/request row stays only for comparison.",
    ]


def scenario(name: str | None) -> dict[str, Any]:
    return dict(SCENARIOS.get(name or "", {}))


def notes_for(name: str | None) -> list[str]:
    return seed_notes() if name == "seed" else []
