"""bench/coldboot.py's verdicts on the boots of one lease (the boots themselves run on the H200:
`bash bench/gpu.sh coldboot-cog`, `coldboot-rest`, `coldboot-again`)."""

from __future__ import annotations

from typing import Any

from bench.coldboot import checks

SAME = ["a", "b"]


def boot(ready_s: float, greedy: list[str] = SAME, *pack_lines: str) -> dict[str, Any]:
    return {"ready_s": ready_s, "greedy": greedy, "pack_lines": list(pack_lines)}


def test_the_bars_are_judged_on_each_kinds_median() -> None:
    boots = {
        "cog-empty": boot(113.6),
        "cog-pack": boot(50.5, SAME, "compile-cache pack x: used, 444 files"),
        "cog-empty-2": boot(104.0),
        "cog-pack-2": boot(40.0),
        "cog-empty-3": boot(106.0),
        "cog-pack-3": boot(41.0),
    }
    bars = checks(boots)["bars_s"]
    assert bars["cog-empty"] == {"bar": 110.0, "ready_s": [113.6, 104.0, 106.0], "median_s": 106.0, "met": True}
    assert bars["cog-pack"]["median_s"] == 41.0 and bars["cog-pack"]["met"]
    boots["cog-pack-3"] = boot(46.0)
    assert not checks(boots)["bars_s"]["cog-pack"]["met"]  # median 46.0


def test_every_repeat_must_answer_as_the_empty_boot_did() -> None:
    boots = {"cog-empty": boot(100.0), "cog-pack": boot(40.0), "cog-pack-2": boot(40.0, ["a", "c"])}
    assert checks(boots)["cog-pack_same_greedy_text"] is False
    boots["cog-pack-2"] = boot(40.0)
    assert checks(boots)["cog-pack_same_greedy_text"] is True


def test_the_mismatched_pack_is_one_refusal_and_no_slower_than_the_empty_median() -> None:
    refused = "compile-cache pack u: not used, made for another start (packages.vllm); starting without it"
    boots = {"cog-empty": boot(118.0), "cog-empty-2": boot(100.0), "cog-mismatch": boot(104.0, SAME, refused)}
    found = checks(boots)
    assert found["cog-mismatch_one_line"] and found["cog-mismatch_ready_vs_empty"] == 0.954  # of 109.0
    assert found["cog-mismatch_not_slower"]
    boots["cog-mismatch"] = boot(120.0, SAME, refused, refused)
    found = checks(boots)
    assert not found["cog-mismatch_one_line"] and not found["cog-mismatch_not_slower"]
