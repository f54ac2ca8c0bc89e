"""Which LoRA adapters load: a base model named unlike the served one is a warning, only what
cannot load is refused. On the real engine (vLLM's CPU build, the tiny model), through the real
HTTP server and the official openai SDK; adapters are random PEFT adapters
(`shared.models.random_adapter`), loaded at start (BUNDLE_LORA_MODULES) and at runtime.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shared.engine.lora import base_warning, load_static, same_model, served_model_names
from shared.engine.vllm_startup import open_engine, resolve_model_path
from shared.errors import InvalidRequest
from shared.models.random_adapter import write_adapter
from shared.service import Service
from shared.settings import Settings
from tests.conftest import WITHOUT_ENGINE, LiveServers

API_KEY = "lora-base-test-key"
BASE = "tiny"
RENAMED_BASE = "meta-llama/Meta-Llama-3.1-8B-Instruct"
SETTINGS = dict(
    max_num_seqs=8,
    max_model_len=256,
    enforce_eager=True,
    enable_lora=True,
    max_lora_rank=8,
    max_loras=2,
    max_loaded_loras=4,
)


# --- the names (no engine) --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("served", "base", "same"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", True),
        ("meta-llama/Llama-3.1-8B-Instruct", "/models/Llama-3.1-8B-Instruct/", True),
        (
            "meta-llama/Llama-3.1-8B-Instruct",
            "/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/0e9e39f",
            True,
        ),
        ("meta-llama/Llama-3.1-8B-Instruct", RENAMED_BASE, False),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-2-7b-hf", False),
    ],
)
def test_a_base_name_is_the_served_model_by_id_path_or_hub_cache_folder(
    served: str, base: str, same: bool
) -> None:
    assert same_model(base, served) is same


def test_the_served_models_own_folder_is_among_its_names() -> None:
    """The folder the engine loads (what `resolve_model_path` gives) is the served model, so an
    adapter made on it is not warned about; another base name is."""
    settings = Settings()
    own = resolve_model_path(settings)
    assert own in served_model_names(settings) and own != settings.model
    assert base_warning("own", own, settings) is None
    assert base_warning("own", own + "/", settings) is None
    warning = base_warning("renamed", RENAMED_BASE, settings)
    assert warning is not None and RENAMED_BASE in warning and "'renamed'" in warning


# --- on the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = Path(resolve_model_path(Settings()))
    root = tmp_path_factory.mktemp("base-adapters")
    return {
        "own": write_adapter(root / "own", model, seed=11, base=str(model)),
        "renamed": write_adapter(root / "renamed", model, seed=12, base=RENAMED_BASE),
        "wide": write_adapter(root / "wide", model, seed=13, base=str(model), widen_by=16),
        "alien": _with_module_the_model_lacks(write_adapter(root / "alien", model, seed=14, base=str(model))),
        "rank16": write_adapter(root / "rank16", model, seed=15, rank=16, base=str(model)),
    }


def _with_module_the_model_lacks(adapter: Path) -> Path:
    """The adapter with its v_proj weights renamed to a module no Llama layer has."""
    from safetensors.torch import load_file, save_file

    weights = adapter / "adapter_model.safetensors"
    tensors = {key.replace("v_proj", "x_proj"): value for key, value in load_file(str(weights)).items()}
    save_file(tensors, str(weights))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "x_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


@pytest.fixture(scope="module")
def lora_live(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServers]:
    if os.environ.get(WITHOUT_ENGINE):
        pytest.skip("this run installs no engine (the Makefile's Python 3.12 run)")
    settings = Settings(
        **SETTINGS,
        lora_modules={"own": str(adapters["own"]), "renamed": str(adapters["renamed"])},
        lora_cache_dir=tmp_path_factory.mktemp("lora-cache"),
    )
    servers = LiveServers(engine_settings=settings)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def server(lora_live: LiveServers) -> tuple[str, Service]:
    return lora_live.serve(api_key=API_KEY)


@pytest.fixture
def client(server: tuple[str, Service]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture
def http(server: tuple[str, Service]) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server[0], headers=headers, timeout=120) as session:
        yield session


def cards(client: openai.OpenAI) -> dict[str, dict[str, Any]]:
    return {model.id: model.model_extra or {} for model in client.models.list()}


def greedy(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(
        model=model,
        prompt="the quick brown fox",
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return answer.choices[0].text


def load(http: httpx.Client, name: str, path: Path) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(http: httpx.Client, name: str) -> None:
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).is_success


def engine_lora_ids(lora_live: LiveServers) -> set[int]:
    return set(lora_live.call(lora_live.engine.llm.list_loras()))


def test_start_time_adapters_on_the_own_folder_and_on_a_renamed_base_both_load(
    client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    listed = cards(client)
    assert listed["own"]["base_model"] == str(resolve_model_path(Settings()))
    assert listed["own"]["warning"] is None
    assert listed["renamed"]["base_model"] == RENAMED_BASE
    assert RENAMED_BASE in listed["renamed"]["warning"] and "'tiny'" in listed["renamed"]["warning"]
    assert "warning" not in listed[BASE]  # the base's card is vLLM's, unchanged
    base = greedy(client, BASE)
    assert greedy(client, "own") != base and greedy(client, "renamed") != base  # both really applied


def test_a_runtime_adapter_made_for_the_own_folder_loads_without_a_warning(
    client: openai.OpenAI, http: httpx.Client, adapters: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="shared.engine.lora"):
        response = load(http, "own-again", adapters["own"])
    try:
        assert response.status_code == 200, response.text
        assert cards(client)["own-again"]["warning"] is None
        assert greedy(client, "own-again") == greedy(client, "own")  # the same weights
        assert [r for r in caplog.records if "own-again" in r.getMessage() and "loaded" in r.getMessage()]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        unload(http, "own-again")


def test_a_runtime_adapter_naming_another_base_loads_with_a_logged_warning(
    client: openai.OpenAI, http: httpx.Client, adapters: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="shared.engine.lora"):
        response = load(http, "renamed-again", adapters["renamed"])
    try:
        assert response.status_code == 200, response.text
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "'renamed-again'" in warned[0] and RENAMED_BASE in warned[0]
        assert cards(client)["renamed-again"]["warning"] == warned[0]
        assert greedy(client, "renamed-again") == greedy(client, "renamed")
    finally:
        unload(http, "renamed-again")


@pytest.mark.parametrize(
    ("adapter", "code", "words"),
    [
        ("wide", "invalid_lora_adapter", "cannot be loaded on this model"),
        ("alien", "invalid_lora_adapter", "x_proj"),
        ("rank16", "lora_rank_too_high", "rank 16"),
    ],
)
def test_an_adapter_that_cannot_load_is_a_400_saying_why_and_leaves_nothing(
    client: openai.OpenAI,
    http: httpx.Client,
    lora_live: LiveServers,
    adapters: dict[str, Path],
    adapter: str,
    code: str,
    words: str,
) -> None:
    """Its base names the served model's own folder: only the weights are wrong."""
    before = engine_lora_ids(lora_live)
    response = load(http, f"bad-{adapter}", adapters[adapter])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and words in error["message"] and error["param"] == "lora_path"
    assert engine_lora_ids(lora_live) == before
    assert f"bad-{adapter}" not in cards(client)


def test_a_start_time_adapter_with_too_high_a_rank_stops_the_start_naming_the_setting(
    lora_live: LiveServers, adapters: dict[str, Path]
) -> None:
    """Checked before the engine sees it (the engine is not touched: the rank is read first)."""
    settings = Settings(**SETTINGS, lora_modules={"big": str(adapters["rank16"])})
    with pytest.raises(InvalidRequest) as refused:
        lora_live.call(load_static(settings, lora_live.engine))  # type: ignore[arg-type]
    assert str(refused.value).startswith(
        f"BUNDLE_LORA_MODULES: big={adapters['rank16']}: adapter 'big' has rank 16"
    )


def test_a_start_time_adapter_of_the_wrong_shape_stops_the_start_with_its_reason(
    adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A whole start on the real engine: it comes up, the adapter fails to load, the start fails
    naming the setting and vLLM's reason, and the engine is shut down again."""
    if os.environ.get(WITHOUT_ENGINE):
        pytest.skip("this run installs no engine (the Makefile's Python 3.12 run)")
    settings = Settings(**SETTINGS, lora_modules={"wide": str(adapters["wide"])}, lora_cache_dir=tmp_path)

    async def start() -> None:
        async with open_engine(settings):
            raise AssertionError("the engine started with an adapter it cannot load")

    with pytest.raises(InvalidRequest) as refused:
        asyncio.run(start())
    message = str(refused.value)
    assert message.startswith(f"BUNDLE_LORA_MODULES: wide={adapters['wide']}: adapter 'wide' cannot be loaded")
