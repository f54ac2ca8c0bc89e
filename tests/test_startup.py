"""The start-up benchmark: its log reading (against both wordings of vLLM's lines it must read)
and one real start of `python -m shared.serve` on the CPU engine, phases and all (the start the
shutdown test then ends with SIGTERM: tests/real_server.py, RealStart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import startup
from bench.startup import milestones, phases
from tests.real_server import RealStart

SPAWN = 1000.0


def stamped(*lines: tuple[float, str]) -> list[tuple[float, str]]:
    return [(SPAWN + at, text) for at, text in lines]


def test_reads_markers_and_vllm_lines_in_either_wording() -> None:
    lines = stamped(
        (0.5, f"bundle-startup interpreter {SPAWN + 0.4}"),
        (3.0, f"bundle-startup imports {SPAWN + 3.0}"),
        (3.1, f"bundle-startup settings {SPAWN + 3.1}"),
        (4.0, "(APIServer) [model.py:700] Resolved architecture: LlamaForCausalLM"),
        (5.0, "(EngineCore_DP0) [core.py:93] Initializing a V1 LLM engine (v0.26.0) with config: ..."),
        (9.0, "(EngineCore_DP0) [default_loader.py:291] Loading weights took 2.10 seconds"),
        (9.5, "(EngineCore_DP0) [gpu_model_runner.py:2000] Model loading took 15.0 GiB and 4.2 s"),
        (30.0, "(EngineCore_DP0) [monitor.py:34] torch.compile takes 20.11 s in total"),
        (31.0, "(EngineCore_DP0) [kv_cache_utils.py:1000] GPU KV cache size: 1,234,567 tokens"),
        (36.0, "(EngineCore_DP0) [gpu_model_runner.py:3000] Graph capturing finished in 5 secs, took 0.5 GiB"),
        (36.5, "(EngineCore_DP0) [core.py:200] init engine (profile, create kv cache, warmup model) took 27 s"),
        (37.0, f"bundle-startup engine {SPAWN + 37.0}"),
        (37.1, f"bundle-startup app {SPAWN + 37.1}"),
    )
    seen = milestones(lines, SPAWN)
    assert seen["interpreter"] == pytest.approx(0.4)  # a marker's own timestamp, not its arrival
    assert seen["weights_loaded"] == pytest.approx(9.5)  # "Model loading took" preferred
    assert seen["torch_compile"] == pytest.approx(30.0)  # older "takes" wording
    durations = phases(seen)
    assert list(durations) == [name for name in startup.PHASES if name in seen]
    assert durations["torch_compile"] == pytest.approx(20.5)
    assert durations["cuda_graphs"] == pytest.approx(5.0)
    assert sum(durations.values()) == pytest.approx(37.1)


def test_a_missing_line_is_left_out_not_guessed() -> None:
    lines = stamped(
        (2.0, f"bundle-startup imports {SPAWN + 2.0}"),
        (9.0, "INFO torch.compile took 4.00 s in total"),
        (12.0, f"bundle-startup engine {SPAWN + 12.0}"),
    )
    durations = phases(milestones(lines, SPAWN))
    assert durations == {"imports": 2.0, "torch_compile": 7.0, "engine_started": 3.0}


def test_bad_arguments_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        startup.main(["--paths", "eager,lukewarm"])
    assert exited.value.code == 2
    assert "lukewarm" in capsys.readouterr().err


def test_one_real_cpu_start_produces_every_phase_of_the_eager_path(real_start: RealStart) -> None:
    assert real_start.exit_code == 0
    report = json.loads((real_start.out / "startup.json").read_text())
    assert report["schema"] == "bundle-startup/1" and report["model"] == "tiny"
    assert set(report["machine"]) == {"gpu", "cpu", "cores"} and report["machine"]["cores"] >= 1
    eager = report["paths"]["eager"]
    (run,) = eager["runs"]
    # The CPU build in eager mode compiles nothing and captures no graphs: those are absent.
    expected = set(startup.PHASES) - {"torch_compile", "cuda_graphs"}
    assert set(run["phases"]) == expected
    assert sum(run["phases"].values()) == pytest.approx(run["first_token_s"], abs=0.01)
    assert eager["first_token_s"]["median"] == run["first_token_s"]
    assert set(eager["phases"]["imports"]) == {"min", "median", "max"}
    # No sleep mode on vLLM's CPU build: said, not simulated.
    assert report["paths"]["wake"]["runs"] == [] and "unsupported" in report["paths"]["wake"]
    table = (real_start.out / "startup.md").read_text()
    assert "| engine_core_up |" in table and "unsupported" in table


def test_merge_keeps_the_paths_measured_earlier(tmp_path: Path) -> None:
    stats = {"min": 1.0, "median": 1.0, "max": 1.0}
    run = {"phases": {"imports": 1.0}, "first_token_s": 1.0}
    eager = {"runs": [run], "first_token_s": stats, "phases": {"imports": stats}}
    earlier = {"schema": "bundle-startup/1", "paths": {"eager": eager}}
    (tmp_path / "startup.json").write_text(json.dumps(earlier))
    # The wake path alone starts no server; on the CPU build it is reported unsupported at once.
    assert startup.main(["--paths", "wake", "--runs", "1", "--out", str(tmp_path), "--merge"]) == 0
    merged = json.loads((tmp_path / "startup.json").read_text())
    assert set(merged["paths"]) == {"eager", "wake"}
    assert merged["paths"]["eager"] == earlier["paths"]["eager"]
