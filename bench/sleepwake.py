"""Sleep/wake check: one engine through the lifecycle functions Modal's snapshot hooks call
(start, warm up, sleep, wake), and what waking costs and keeps.

It records: sleep seconds; wake-up -> first token; the token ids of a fixed temperature-0 prompt
set before sleep and after wake (they must be identical; each prompt runs alone, so batching
cannot change the arithmetic); and decode throughput at N concurrent streams before sleep and
after wake (distinct random prompts each wave, so prefix caching cannot flatter either side).

    python -m bench.sleepwake --streams 256 --out bench/gpu-results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shared.engine.contract import Engine, SamplingRequest
from shared.engine.vllm import VLLMEngine
from shared.engine.vllm_startup import sleep_mode_available
from shared.lifecycle import EngineLifecycle, PromptMaker, warm_up
from shared.settings import Settings

SCHEMA = "bundle-sleepwake/1"


async def token_ids(engine: VLLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids per prompt, one prompt at a time, straight from vLLM's output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    results = []
    for prompt in prompts:
        final = None
        async for output in engine.llm.generate(
            {"prompt_token_ids": prompt}, params, f"ids-{uuid.uuid4().hex}"
        ):
            final = output
        assert final is not None
        results.append(list(final.outputs[0].token_ids))
    return results


async def throughput(
    engine: Engine, prompts: PromptMaker, streams: int, prompt_tokens: int, output_tokens: int
) -> float:
    """Output tokens per second of one wave of `streams` concurrent requests."""

    async def one() -> int:
        request = SamplingRequest(
            prompt_token_ids=prompts.ids(prompt_tokens),
            max_tokens=output_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        count = 0
        async for delta in engine.generate(f"tput-{uuid.uuid4().hex}", request):
            count += delta.token_count
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(streams)))
    return sum(counts) / (time.perf_counter() - started)


async def measure(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    lifecycle = EngineLifecycle(settings)
    engine = await lifecycle.start()
    assert isinstance(engine, VLLMEngine)
    try:
        await warm_up(engine, lifecycle.settings)
        vocab = engine.info.vocab_size or 256
        fixed = [PromptMaker(vocab, seed).ids(args.prompt_tokens // 4) for seed in range(args.fixed_prompts)]
        waves = PromptMaker(vocab, 7)
        wave = (args.streams, args.prompt_tokens, args.output_tokens)
        ids_before = await token_ids(engine, fixed, args.fixed_tokens)
        before = [await throughput(engine, waves, *wave) for _ in range(args.rounds)]
        sleep_s = await lifecycle.sleep()
        report = await lifecycle.wake()
        ids_after = await token_ids(engine, fixed, args.fixed_tokens)
        after = [await throughput(engine, waves, *wave) for _ in range(args.rounds)]
    finally:
        await lifecycle.stop()
    ratio = statistics.median(after) / statistics.median(before)
    return {
        "sleep_mode": sleep_mode_available(),
        "sleep_s": round(sleep_s, 3),
        "wake_up_s": round(report.wake_up_s, 3),
        "wake_first_token_s": round(report.total_s, 3),
        "token_ids_identical": ids_before == ids_after,
        "fixed_prompts": len(fixed),
        "tokens_per_s_before": [round(v, 1) for v in before],
        "tokens_per_s_after": [round(v, 1) for v in after],
        "throughput_after_over_before": round(ratio, 4),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sleepwake", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams per throughput wave")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="throughput waves on each side (median)")
    parser.add_argument("--fixed-prompts", type=int, default=16, help="temperature-0 prompts compared")
    parser.add_argument("--fixed-tokens", type=int, default=32, help="tokens generated per fixed prompt")
    parser.add_argument("--out", type=Path, default=Path("results/cpu"), help="writes sleepwake.json")
    args = parser.parse_args(argv)
    if min(args.streams, args.prompt_tokens, args.output_tokens, args.rounds, args.fixed_prompts) < 1:
        parser.error("counts must be at least 1")
    settings = Settings()
    result = {
        "schema": SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": settings.model_name,
        **asyncio.run(measure(args, settings)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sleepwake.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["token_ids_identical"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
