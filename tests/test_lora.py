"""LoRA adapters on the real engine (vLLM's CPU build, the tiny model), through the real HTTP
server and the official openai SDK.

The session's shared engine (tests/conftest.py) runs without LoRA, so this module starts one
engine of its own with `enable_lora`, small enough for the 2-core box. Its adapters are random
PEFT adapters built by `shared.models.random_adapter`: "alpha" is loaded at start (BUNDLE_LORA_MODULES),
the others at runtime through POST /v1/load_lora_adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import tarfile
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cog_bridge import with_adapter
from cog_inputs import chat_request_from_inputs

from shared.engine.lora import COG_PREFIX
from shared.engine.vllm_startup import resolve_model_path
from shared.models.random_adapter import write_adapter
from shared.service import Service
from shared.settings import Settings
from tests.conftest import WITHOUT_ENGINE, LiveServers, wait_until
from tests.gate import Gate

API_KEY = "lora-test-key"
BASE = "tiny"
PROMPT = "the quick brown fox"
TOKENS = 24
LORA_SETTINGS = dict(
    max_num_seqs=16,
    max_model_len=512,
    enforce_eager=True,
    enable_lora=True,
    max_lora_rank=8,
    max_loras=2,
    max_loaded_loras=3,
)


# --- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = Path(resolve_model_path(Settings()))
    root = tmp_path_factory.mktemp("adapters")
    made = {
        "alpha": write_adapter(root / "alpha", model, seed=1),
        "beta": write_adapter(root / "beta", model, seed=2),
        "gamma": write_adapter(root / "gamma", model, seed=3),
        "rank16": write_adapter(root / "rank16", model, seed=4, rank=16),
        "wide": write_adapter(root / "wide", model, seed=5, widen_by=16, base=None),
    }
    (root / "empty").mkdir()
    made["empty"] = root / "empty"
    return made


@pytest.fixture(scope="module")
def lora_live(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServers]:
    if os.environ.get(WITHOUT_ENGINE):
        pytest.skip("this run installs no engine (the Makefile's Python 3.12 run)")
    settings = Settings(
        **LORA_SETTINGS,
        lora_modules={"alpha": str(adapters["alpha"])},
        lora_cache_dir=tmp_path_factory.mktemp("lora-cache"),  # URL adapters unpack here, not in ~/.cache
    )
    servers = LiveServers(engine_settings=settings)
    yield servers
    servers.close()


@pytest.fixture
def lora_gate(lora_live: LiveServers) -> Iterator[Gate]:
    """Holds generations of this module's engine (tests/gate.py); released when the test ends."""
    gate = Gate(lora_live.gate_dir)
    yield gate
    gate.release_all()


@pytest.fixture(scope="module")
def server(lora_live: LiveServers) -> tuple[str, Service]:
    return lora_live.serve(api_key=API_KEY)


@pytest.fixture
def client(server: tuple[str, Service]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server: tuple[str, Service]) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server[0], headers=headers, timeout=120) as client:
        yield client


@contextlib.contextmanager
def loaded(http: httpx.Client, name: str, path: Path | str) -> Iterator[None]:
    response = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert response.status_code == 200, response.text
    try:
        yield
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def greedy(client: openai.OpenAI, model: str, **extra: Any) -> str:
    answer = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True, **extra},
    )
    assert answer.model == model  # the response names what was asked for
    return answer.choices[0].text


def engine_lora_ids(lora_live: LiveServers) -> set[int]:
    return set(lora_live.call(lora_live.engine.llm.list_loras()))


def error_of(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


# --- tokens ---------------------------------------------------------------------------------------
def test_an_adapter_changes_the_tokens_and_repeats_them_at_temperature_0(client: openai.OpenAI) -> None:
    base = greedy(client, BASE)
    adapted = greedy(client, "alpha")
    assert adapted != base
    assert greedy(client, "alpha") == adapted
    assert greedy(client, BASE) == base


def test_two_adapters_and_the_base_in_one_batch_each_get_their_own_tokens(
    client: openai.OpenAI,
    http: httpx.Client,
    server: tuple[str, Service],
    lora_live: LiveServers,
    adapters: dict[str, Path],
) -> None:
    with loaded(http, "beta", adapters["beta"]):
        models = [BASE, "alpha", "beta"]
        alone = {model: greedy(client, model) for model in models}
        assert len(set(alone.values())) == 3  # three different models

        results: list[tuple[str, str]] = []

        async def together() -> list[tuple[str, str]]:
            aclient = openai.AsyncOpenAI(
                base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120
            )

            async def stream(model: str) -> tuple[str, str]:
                chunks = []
                events = await aclient.completions.create(
                    model=model,
                    prompt=PROMPT,
                    max_tokens=TOKENS,
                    temperature=0.0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                async for chunk in events:
                    chunks.append(chunk.choices[0].text if chunk.choices else "")
                return model, "".join(chunks)

            async with aclient:
                return await asyncio.gather(*(stream(model) for model in models * 2))

        # Sent to a paused engine, all six wait in its queue and start in one step: one batch.
        with lora_live.engine_paused():
            sending = threading.Thread(target=lambda: results.extend(asyncio.run(together())))
            sending.start()
            wait_until(lambda: lora_live.engine.running_requests() == len(models) * 2, timeout=60)
        sending.join(timeout=120)
        assert len(results) == len(models) * 2
        for model, text in results:
            assert text == alone[model], model


def test_a_request_id_is_bound_to_its_adapter(http: httpx.Client, adapters: dict[str, Path]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    headers = {"X-Request-Id": f"lora-identity-{time.time_ns()}"}
    first = http.post("/v1/completions", json={**body, "model": "alpha"}, headers=headers)
    assert first.status_code == 200, first.text
    replay = http.post("/v1/completions", json={**body, "model": "alpha"}, headers=headers)
    assert replay.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    for other in ("tiny", "gamma"):
        with loaded(http, "gamma", adapters["gamma"]) if other == "gamma" else contextlib.nullcontext():
            conflict = http.post("/v1/completions", json={**body, "model": other}, headers=headers)
        assert conflict.status_code == 422, conflict.text
        assert error_of(conflict)["code"] == "request_id_conflict"


# --- listing, loading, unloading ------------------------------------------------------------------
def test_models_lists_the_base_and_each_adapter_with_its_parent(
    client: openai.OpenAI, http: httpx.Client, adapters: dict[str, Path]
) -> None:
    with loaded(http, "beta", adapters["beta"]):
        cards = {model.id: model for model in client.models.list()}
        assert set(cards) == {BASE, "alpha", "beta"}
        assert cards[BASE].model_extra["parent"] is None
        for name in ("alpha", "beta"):
            assert cards[name].model_extra["parent"] == BASE
            assert cards[name].model_extra["root"] == str(adapters[name])
    assert {model.id for model in client.models.list()} == {BASE, "alpha"}


def test_after_unload_the_adapter_is_gone_and_nothing_leaks(
    client: openai.OpenAI, http: httpx.Client, lora_live: LiveServers, adapters: dict[str, Path]
) -> None:
    before = engine_lora_ids(lora_live)
    with loaded(http, "gamma", adapters["gamma"]):
        greedy(client, "gamma")
        assert len(engine_lora_ids(lora_live)) == len(before) + 1
    assert "gamma" not in {model.id for model in client.models.list()}
    with pytest.raises(openai.NotFoundError) as caught:
        greedy(client, "gamma")
    assert caught.value.code == "model_not_found"
    assert engine_lora_ids(lora_live) == before  # the engine dropped it too
    metrics = http.get("/metrics").text
    assert 'bundle_model_requests_total{model="alpha"}' in metrics
    assert 'model="gamma"' not in metrics  # its series went with it: labels stay bounded


def test_unloading_while_a_stream_runs_lets_it_finish_then_drops_the_adapter(
    server: tuple[str, Service],
    http: httpx.Client,
    lora_live: LiveServers,
    lora_gate: Gate,
    adapters: dict[str, Path],
) -> None:
    before = engine_lora_ids(lora_live)
    assert http.post(
        "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(adapters["gamma"])}
    ).is_success
    with lora_gate.hold(after=1) as held:
        body = {
            "model": "gamma",
            "prompt": held.prompt(PROMPT),
            "max_tokens": 200,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            held.wait_held()
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).is_success
            assert len(engine_lora_ids(lora_live)) == len(before) + 1  # kept for the running stream
            held.release()
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert '"completion_tokens":200' in rest[-2]  # it ran to its end on the unloaded adapter
    deadline = time.monotonic() + 30
    while engine_lora_ids(lora_live) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_lora_ids(lora_live) == before


# --- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("adapter", "status", "code", "words"),
    [
        ("missing", 400, "lora_not_found", "no such directory"),
        ("empty", 400, "invalid_lora_adapter", "adapter_config.json"),
        ("rank16", 400, "lora_rank_too_high", "rank 16"),
        ("wide", 400, "invalid_lora_adapter", "cannot be loaded on this model"),
    ],
)
def test_a_bad_adapter_is_a_400_with_its_reason_and_leaves_nothing_behind(
    http: httpx.Client,
    lora_live: LiveServers,
    adapters: dict[str, Path],
    tmp_path: Path,
    adapter: str,
    status: int,
    code: str,
    words: str,
) -> None:
    before = engine_lora_ids(lora_live)
    path = adapters.get(adapter, tmp_path / "no-such-dir")
    response = http.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{adapter}", "lora_path": str(path)})
    assert response.status_code == status, response.text
    assert error_of(response)["code"] == code
    assert words in error_of(response)["message"]
    assert engine_lora_ids(lora_live) == before
    assert f"bad-{adapter}" not in {card["id"] for card in http.get("/v1/models").json()["data"]}


def test_unknown_names_duplicates_and_the_bound_are_clear_4xx(
    client: openai.OpenAI, http: httpx.Client, adapters: dict[str, Path]
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.code == "model_not_found" and "'nope'" in caught.value.message
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert gone.status_code == 404 and "nope" in error_of(gone)["message"]
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(adapters["beta"])})
    assert again.status_code == 400 and "already loaded" in error_of(again)["message"]
    base = http.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": str(adapters["beta"])})
    assert base.status_code == 400 and "base model" in error_of(base)["message"]
    # max_loaded_loras is 3 and alpha holds one slot.
    with loaded(http, "beta", adapters["beta"]), loaded(http, "gamma", adapters["gamma"]):
        full = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(adapters["beta"])}
        )
        assert full.status_code == 400 and error_of(full)["code"] == "lora_limit_reached"


def test_the_adapter_routes_need_the_api_key(server: tuple[str, Service], adapters: dict[str, Path]) -> None:
    body = {"lora_name": "beta", "lora_path": str(adapters["beta"])}
    assert httpx.post(f"{server[0]}/v1/load_lora_adapter", json=body).status_code == 401
    assert httpx.post(f"{server[0]}/v1/unload_lora_adapter", json={"lora_name": "alpha"}).status_code == 401


def test_a_server_without_an_api_key_refuses_the_adapter_routes(
    lora_live: LiveServers, adapters: dict[str, Path]
) -> None:
    """Without BUNDLE_API_KEY nothing guards them, and they read paths and fetch URLs the caller
    names: 403, nothing loaded; adapters loaded at start still serve."""
    url, _ = lora_live.serve()
    body = {"lora_name": "beta", "lora_path": str(adapters["beta"])}
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        reply = httpx.post(f"{url}{route}", json=body)
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "api_key_required", reply.text
    names = {card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]}
    assert "alpha" in names and "beta" not in names


# --- adapters from URLs, and Cog's input ----------------------------------------------------------
@pytest.fixture(scope="module")
def file_server(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]) -> Iterator[str]:
    """A real HTTP server with one adapter as a .tar.gz and one file that is no tar."""
    root = tmp_path_factory.mktemp("served")
    with tarfile.open(root / "beta.tar.gz", "w:gz") as tar:
        tar.add(adapters["beta"], arcname="beta-adapter")  # wrapped in a folder, as tars often are
    (root / "junk.tar").write_bytes(b"this is not a tar archive")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_an_adapter_from_a_tar_url_is_downloaded_and_serves_its_tokens(
    client: openai.OpenAI, http: httpx.Client, file_server: str
) -> None:
    local = greedy(client, "alpha")
    with loaded(http, "beta", f"{file_server}/beta.tar.gz"):
        from_url = greedy(client, "beta")
    assert from_url != local
    for path, words in (("missing.tar", "HTTP 404"), ("junk.tar", "not a readable tar")):
        response = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "url", "lora_path": f"{file_server}/{path}"}
        )
        assert response.status_code == 400 and error_of(response)["code"] == "lora_download_failed"
        assert words in error_of(response)["message"]


def test_cogs_adapter_input_loads_once_and_selects_the_adapter(
    server: tuple[str, Service], lora_live: LiveServers, file_server: str
) -> None:
    service = server[1]
    body = chat_request_from_inputs(service.settings, prompt="hi", max_tokens=4)
    url = f"{file_server}/beta.tar.gz"
    first = lora_live.call(with_adapter(service, body, url))
    second = lora_live.call(with_adapter(service, body, url))
    assert first.model == second.model and first.model.startswith(COG_PREFIX)
    assert [adapter.name for adapter in service.adapters.loaded()].count(first.model) == 1
    assert lora_live.call(with_adapter(service, body, "alpha")).model == "alpha"  # a name loaded at start
    assert lora_live.call(with_adapter(service, body, "")).model == BASE
    lora_live.call(service.adapters.unload(first.model))


# --- settings (no engine) ---------------------------------------------------------------------------
def test_lora_modules_take_json_or_name_equals_source_pairs() -> None:
    assert Settings(lora_modules='{"a": "/x"}').lora_modules == {"a": "/x"}
    assert Settings(lora_modules="a=/x, b=org/y").lora_modules == {"a": "/x", "b": "org/y"}
    with pytest.raises(ValueError, match="name=source"):
        Settings(lora_modules="just-a-path")


def test_modal_keeps_adapters_on_a_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_modal_app import load_modal_app

    module = load_modal_app(monkeypatch, BUNDLE_ENABLE_LORA="true", BUNDLE_LORA_MODULES="sql=org/sql-lora")
    info = module.Server._get_class_service_function().info()
    # The container's settings, rebuilt from its environment only.
    env = {
        k.removeprefix("BUNDLE_").lower(): v for k, v in module.CONTAINER_ENV.items() if k.startswith("BUNDLE_")
    }
    container = Settings(**env)
    assert container.enable_lora and container.lora_modules == {"sql": "org/sql-lora"}
    lora_dir = str(container.lora_dir)
    assert any(lora_dir.startswith(f"{mount}/") for mount in info.volumes)  # tar URLs unpack there
    assert module.CONTAINER_ENV["HF_HOME"] in info.volumes  # Hugging Face ids download there


def test_replicate_users_run_a_fine_tune_by_url_through_the_real_cog_server(
    tmp_path: Path, file_server: str
) -> None:
    """coglet 0.23.1 serving cog/predict.py with LoRA on: the `lora` input downloads the tar once,
    its tokens differ from the base's and repeat; a URL that is no adapter fails the prediction."""
    if os.environ.get(WITHOUT_ENGINE):
        pytest.skip("this run installs no engine (the Makefile's Python 3.12 run)")
    from tests.test_cog import running_cog_server

    env = {
        "COG_MAX_CONCURRENCY": "2",
        "BUNDLE_MAX_MODEL_LEN": "512",
        "BUNDLE_MAX_NUM_SEQS": "16",
        "BUNDLE_ENABLE_LORA": "true",
        "BUNDLE_MAX_LORA_RANK": "8",
        "BUNDLE_LORA_CACHE_DIR": str(tmp_path / "lora-cache"),
    }
    with running_cog_server(tmp_path, ready_within_s=300, **env) as server:
        url = server.url

        def predict(lora: str) -> dict[str, Any]:
            inputs = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "lora": lora}
            response = httpx.post(f"{url}/predictions", json={"input": inputs}, timeout=120)
            assert response.status_code == 200, response.text
            return dict(response.json())

        base = predict("")
        tuned = predict(f"{file_server}/beta.tar.gz")
        assert base["status"] == tuned["status"] == "succeeded", (base, tuned)
        assert "".join(tuned["output"]) != "".join(base["output"])
        # Joined text: how coglet splits the stream into chunks depends on timing.
        assert "".join(predict(f"{file_server}/beta.tar.gz")["output"]) == "".join(tuned["output"])
        cached = [p for p in (tmp_path / "lora-cache").iterdir() if not p.name.startswith("base-zero-")]
        assert len(cached) == 1  # downloaded once (beside the CPU build's zero adapter)
        bad = predict(f"{file_server}/junk.tar")
        assert bad["status"] == "failed" and "not a readable tar" in bad["error"]
