"""cost_model/scaling.py: streams per container where the TTFT curve meets the objective."""

from __future__ import annotations

from typing import Any

from cost_model.scaling import advise


def level(streams: int, p50: float, p99: float) -> dict[str, Any]:
    ttft = {"p50": p50, "p90": p99, "p99": p99}
    return {
        "concurrency": streams,
        "output_tokens_per_s": 100.0 * streams,
        "ttft_s": ttft,
        "ttft_later_s": ttft,
    }


def bench(*levels: dict[str, Any]) -> dict[str, Any]:
    return {"targets": {"bundle": {"levels": list(levels)}}}


def test_the_streams_where_each_quantile_meets_the_objective() -> None:
    # P99 rises 0.1 -> 1.1 s over 1 -> 101 streams: 0.01 s per stream, so 0.5 s at 41.
    # P50 rises 0.05 -> 0.55 s: 0.005 s per stream, 0.5 s at 91.
    found = advise(bench(level(1, 0.05, 0.1), level(101, 0.55, 1.1)), ttft_sla_s=0.5)
    assert (found["modal_target_inputs"], found["modal_max_inputs"], found["cog_concurrency_max"]) == (
        41,
        91,
        41,
    )


def test_a_curve_always_within_the_objective_allows_its_last_level() -> None:
    found = advise(bench(level(1, 0.01, 0.02), level(64, 0.05, 0.1)), ttft_sla_s=0.5)
    assert found["modal_target_inputs"] == found["modal_max_inputs"] == 64


def test_one_stream_even_when_it_misses_the_objective() -> None:
    found = advise(bench(level(1, 0.8, 0.9), level(8, 1.0, 1.5)), ttft_sla_s=0.5)
    assert found["modal_target_inputs"] == found["modal_max_inputs"] == 1
