"""Deploy presets: what each sets, and that an explicit setting always wins."""

from __future__ import annotations

import typing

import pytest

from shared.engine.presets import PRESETS, apply_preset
from shared.engine.vllm_startup import engine_args
from shared.settings import Settings


def test_every_preset_name_the_settings_accept_has_knobs_and_no_other() -> None:
    accepted = set(typing.get_args(typing.get_args(Settings.model_fields["preset"].annotation)[0]))
    assert accepted == set(PRESETS)
    for knobs in PRESETS.values():
        assert set(knobs) <= set(Settings.model_fields)  # a preset only sets real settings


def test_a_preset_fills_the_engine_arguments() -> None:
    args = engine_args(Settings(model="/models/m", preset="throughput"), on_cpu=False)
    assert args.quantization == PRESETS["throughput"]["quantization"]
    assert args.max_num_batched_tokens == PRESETS["throughput"]["max_num_batched_tokens"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_an_explicit_setting_wins_over_the_preset(preset: str) -> None:
    explicit = {"quantization": None, "max_num_batched_tokens": 1234, "max_num_seqs": 7, "enforce_eager": False}
    args = engine_args(Settings(model="/models/m", preset=preset, **explicit), on_cpu=False)
    assert (args.quantization, args.max_num_batched_tokens, args.max_num_seqs, args.enforce_eager) == (
        None,
        1234,
        7,
        False,
    )


def test_from_the_environment_an_explicit_variable_wins_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUNDLE_PRESET", "latency")
    monkeypatch.setenv("BUNDLE_MAX_NUM_SEQS", "200")
    settings = apply_preset(Settings())
    assert settings.max_num_seqs == 200
    assert settings.max_num_batched_tokens == PRESETS["latency"]["max_num_batched_tokens"]


def test_on_cpu_a_preset_leaves_quantization_to_the_user() -> None:
    args = engine_args(Settings(model="/models/m", preset="throughput"), on_cpu=True)
    assert args.quantization is None
    assert args.max_num_batched_tokens == PRESETS["throughput"]["max_num_batched_tokens"]
    explicit = engine_args(Settings(model="/models/m", preset="throughput", quantization="fp8"), on_cpu=True)
    assert explicit.quantization == "fp8"


def test_no_preset_changes_nothing() -> None:
    settings = Settings(model="/models/m")
    assert apply_preset(settings) is settings


def test_a_deploy_default_preset_yields_to_the_user_even_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().with_default_preset("throughput").preset == "throughput"
    assert Settings(preset="latency").with_default_preset("throughput").preset == "latency"
    monkeypatch.setenv("BUNDLE_PRESET", "")
    assert Settings().with_default_preset("throughput").preset is None


def test_cuda_graphs_keep_vllms_widths_unless_a_cap_is_set() -> None:
    """The graph sizes count tokens and serve mixed prefill + decode steps, not only decode
    batches: capping them at max_num_seqs slowed sustained load on the H200 (README)."""
    default = engine_args(Settings(model="/models/m", enforce_eager=False, max_num_seqs=256), on_cpu=False)
    assert default.compilation_config.max_cudagraph_capture_size is None  # vLLM decides
    capped = Settings(model="/models/m", enforce_eager=False, cuda_graph_max_batch=128)
    assert engine_args(capped, on_cpu=False).compilation_config.max_cudagraph_capture_size == 128


def test_vllms_server_gets_the_bundles_graph_cap_when_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.servers import vllm_server_command

    monkeypatch.setattr("vllm.platforms.current_platform.is_cpu", lambda: False)
    graphs = {"model": "/models/m", "enforce_eager": False}
    capped = vllm_server_command(Settings(**graphs, cuda_graph_max_batch=128), 9)
    assert capped[capped.index("--compilation-config") + 1] == '{"max_cudagraph_capture_size":128}'
    assert "--compilation-config" not in vllm_server_command(Settings(**graphs), 9)


def test_a_stream_interval_reaches_the_engine_and_vllms_server_only_when_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench.servers import vllm_server_command

    assert engine_args(Settings(model="/models/m", stream_interval=4), on_cpu=True).stream_interval == 4
    assert engine_args(Settings(model="/models/m"), on_cpu=True).stream_interval == 1  # vLLM's default
    monkeypatch.setattr("vllm.platforms.current_platform.is_cpu", lambda: False)
    chunked = vllm_server_command(Settings(model="/models/m", stream_interval=4), 9)
    assert chunked[chunked.index("--stream-interval") + 1] == "4"
    assert "--stream-interval" not in vllm_server_command(Settings(model="/models/m"), 9)
