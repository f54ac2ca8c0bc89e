"""The Modal wrapper: it imports offline, its decorators follow the settings, and the app that
`Server().web.local()` returns (enter hook run locally) serves the core's contract on the CPU
engine with the tiny model. One engine for the whole module."""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import modal
import openai
import pytest
import uvicorn
from modal._partial_function import _find_partial_methods_for_user_cls, _PartialFunctionFlags

from bench.startup import cache_env
from modal_app.settings import ModalSettings
from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "sk-modal-test"


def load_modal_app(monkeypatch: pytest.MonkeyPatch, **env: str) -> ModuleType:
    """Import modal_app.app afresh, as `modal deploy` would, under exactly these BUNDLE_* vars."""
    for name in list(os.environ):
        if name.startswith("BUNDLE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("modal_app.app", None)
    return importlib.import_module("modal_app.app")


# --- offline import and decorator values --------------------------------------------------------
def test_imports_offline_without_token_warnings_as_errors(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODAL_", "BUNDLE_"))}
    env["MODAL_CONFIG_PATH"] = str(tmp_path / "no-modal.toml")  # no token anywhere
    code = (
        "import sys, modal_app.app as m; "
        "assert m.Server is not None and m.app.name == 'vllm-serverless-bundle'; "
        # A thin wrapper: deploying needs neither the engine nor the web stack.
        "heavy = {'vllm', 'torch', 'fastapi'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_decorators_follow_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_modal_app(
        monkeypatch,
        BUNDLE_MODAL_GPU="L40S",
        BUNDLE_MAX_NUM_SEQS="48",
        BUNDLE_MODAL_TIMEOUT_S="900",
        BUNDLE_MODAL_STARTUP_TIMEOUT_S="600",
        BUNDLE_MODAL_REQUIRES_PROXY_AUTH="true",
    )
    settings = ModalSettings()
    info = module.Server._get_class_service_function().info()

    assert info.gpus == [(settings.gpu, 1)] == [("L40S", 1)]
    assert info.timeout == settings.timeout_s == 900
    assert info.startup_timeout == settings.startup_timeout_s == 600
    max_inputs, target_inputs = settings.concurrency(Settings().max_num_seqs, Settings().max_in_flight)
    assert (
        (info.concurrency_info.max_inputs, info.concurrency_info.target_inputs)
        == (
            max_inputs,
            target_inputs,
        )
        == (48, 24)
    )  # max_num_seqs, and half of it
    assert set(info.volumes) == {module.HF_CACHE_DIR, module.VLLM_CACHE_DIR}
    # Every compile cache a start reads lies on the cache volume, the layout whose start-up the
    # benchmark's warm path measures: vLLM's own, inductor's and Triton's.
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert module.CONTAINER_ENV[name].startswith(module.VLLM_CACHE_DIR), name
    assert {k: module.CONTAINER_ENV[k] for k in cache_env(Path("/x"))} == {
        k: v.replace("/x", module.VLLM_CACHE_DIR) for k, v in cache_env(Path("/x")).items()
    }
    assert info.method_details["web"].unauthenticated is False  # requires_proxy_auth


def test_concurrency_overrides_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_modal_app(monkeypatch, BUNDLE_MODAL_MAX_INPUTS="100", BUNDLE_MODAL_TARGET_INPUTS="80")
    concurrency = module.Server._get_class_service_function().info().concurrency_info
    assert (concurrency.max_inputs, concurrency.target_inputs) == (100, 80)
    assert ModalSettings().concurrency(256, 512) == (100, 80)
    unset = ModalSettings(max_inputs=None, target_inputs=None)
    assert unset.concurrency(max_num_seqs=1, max_in_flight=512) == (1, 1)
    assert unset.concurrency(max_num_seqs=7, max_in_flight=512) == (7, 3)
    # Never more inputs than the core admits: the rest would be 429s Modal routed here.
    assert unset.concurrency(max_num_seqs=1024, max_in_flight=512) == (512, 256)
    with pytest.raises(ValueError, match="TARGET_INPUTS"):
        ModalSettings(max_inputs=4, target_inputs=5).concurrency(256, 512)
    with pytest.raises(ValueError, match="MAX_IN_FLIGHT"):
        ModalSettings(max_inputs=600, target_inputs=None).concurrency(256, 512)


def test_the_preset_sets_the_containers_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    # The latency preset runs 64 sequences; a container taking 256 would queue 192 inside vLLM.
    module = load_modal_app(monkeypatch, BUNDLE_PRESET="latency")
    concurrency = module.Server._get_class_service_function().info().concurrency_info
    assert (concurrency.max_inputs, concurrency.target_inputs) == (64, 32)
    explicit = load_modal_app(monkeypatch, BUNDLE_PRESET="latency", BUNDLE_MAX_NUM_SEQS="96")
    concurrency = explicit.Server._get_class_service_function().info().concurrency_info
    assert (concurrency.max_inputs, concurrency.target_inputs) == (96, 48)  # the user's setting wins


def test_the_container_rebuilds_the_deploy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_modal_app(monkeypatch, BUNDLE_MAX_NUM_SEQS="32", BUNDLE_MODAL_GPU="A100-80GB")
    deployed = module.SETTINGS
    # Nothing set: the pinned model and revision are served, and travel to the container.
    assert (deployed.model, deployed.model_revision) == (module.MODEL, module.MODEL_REVISION)
    assert module.CONTAINER_ENV["BUNDLE_MODEL_REVISION"] == module.MODEL_REVISION

    # Inside the container only CONTAINER_ENV is set, and the module is imported again.
    container_env = {k: v for k, v in module.CONTAINER_ENV.items() if k.startswith("BUNDLE_")}
    rebuilt = load_modal_app(monkeypatch, **container_env).SETTINGS
    # Moved onto the volumes on purpose: the cache dir onto the Hugging Face one, the compile
    # caches' root onto vllm-cache (modal_app/caches.py).
    differs = {"cache_dir", "compile_cache_dir"}
    assert rebuilt.model_dump(exclude=differs) == deployed.model_dump(exclude=differs)


def test_an_explicit_model_drops_the_pinned_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_modal_app(monkeypatch, BUNDLE_MODEL="Qwen/Qwen2.5-7B-Instruct")
    assert (module.SETTINGS.model, module.SETTINGS.model_revision) == (
        "Qwen/Qwen2.5-7B-Instruct",
        None,
    )
    assert "BUNDLE_MODEL_REVISION" not in module.CONTAINER_ENV


def test_the_api_key_travels_only_as_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_modal_app(monkeypatch, BUNDLE_API_KEY=API_KEY)
    assert not any(API_KEY in value for value in module.CONTAINER_ENV.values())
    secrets = module.Server._get_class_service_function().info().secrets
    assert any("BUNDLE_API_KEY" in secret for secret in secrets)

    module = load_modal_app(monkeypatch, BUNDLE_API_KEY=API_KEY, BUNDLE_MODAL_SECRET_NAME="llm-keys")
    secrets = module.Server._get_class_service_function().info().secrets
    assert any("llm-keys" in secret for secret in secrets)
    assert not any("BUNDLE_API_KEY" in secret for secret in secrets)


# --- the local app: Server().web.local() served by uvicorn ----------------------------------
class LocalServer:
    def __init__(self, base_url: str, settings: Settings) -> None:
        self.base_url = base_url
        self.settings = settings


@pytest.fixture(scope="module")
def served() -> Iterator[LocalServer]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        module = load_modal_app(
            monkeypatch,
            BUNDLE_MODEL="tiny",
            BUNDLE_MAX_NUM_SEQS="8",
            BUNDLE_MAX_MODEL_LEN="256",
            BUNDLE_API_KEY=API_KEY,
        )
        # .local() runs the enter hook here, then the asgi_app method; Modal warns that the
        # volumes are not mounted locally, which is expected.
        with pytest.warns(UserWarning, match="Volume"):
            web_app = module.Server().web.local()
        assert web_app.state.settings is module.SETTINGS

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(web_app, lifespan="on", log_level="warning"))
        # uvicorn's loop runs the app's lifespan, which opens the engine on that same loop.
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 300
        while not server.started:
            assert thread.is_alive(), "uvicorn exited: the app's lifespan failed to start"
            assert time.monotonic() < deadline, "the engine did not start within 300 s"
            time.sleep(0.2)
        try:
            yield LocalServer(f"http://127.0.0.1:{port}", module.SETTINGS)
        finally:
            server.should_exit = True  # lifespan shutdown closes the engine
            thread.join(timeout=120)
            sock.close()
    assert not thread.is_alive()


def test_health_is_public_and_the_api_is_not(served: LocalServer) -> None:
    assert httpx.get(f"{served.base_url}/health").status_code == 200
    response = httpx.get(f"{served.base_url}/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["message"]


def test_openai_sdk_streams_a_chat_completion(served: LocalServer) -> None:
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text
    assert finish == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_the_local_entrypoint_smoke_runs_against_the_app(served: LocalServer) -> None:
    from modal_app.smoke import run_smoke

    result = asyncio.run(run_smoke(served.base_url, served.settings, max_tokens=24))
    assert result.completion_tokens == 24
    assert result.text
    assert 0 < result.time_to_first_token_s < result.total_s
    assert result.tokens_per_s > 0
    assert "tokens/s" in result.summary()


# --- GPU memory snapshots: hooks and options follow BUNDLE_MODAL_SNAPSHOT --------------------------
def load_recording_cls_options(monkeypatch: pytest.MonkeyPatch, **env: str) -> tuple[ModuleType, dict]:
    """Import the app and keep the keyword arguments it passed to `app.cls` (Modal keeps the
    snapshot options only inside the function definition it builds at deploy time)."""
    passed: dict = {}
    original = modal.App.cls

    def recording(self: modal.App, *args: object, **kwargs: object) -> object:
        passed.update(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modal.App, "cls", recording)
    return load_modal_app(monkeypatch, **env), passed


def enter_hooks(module: ModuleType) -> dict[str, set[str]]:
    user_cls = module.Server._get_user_cls()
    return {
        name: set(_find_partial_methods_for_user_cls(user_cls, flag))
        for name, flag in (
            ("pre", _PartialFunctionFlags.ENTER_PRE_SNAPSHOT),
            ("post", _PartialFunctionFlags.ENTER_POST_SNAPSHOT),
        )
    }


def test_snapshot_on_adds_the_options_and_both_enter_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    module, passed = load_recording_cls_options(monkeypatch, BUNDLE_MODAL_SNAPSHOT="true")
    assert passed["enable_memory_snapshot"] is True
    assert passed["experimental_options"] == {"enable_gpu_snapshot": True}
    assert enter_hooks(module) == {"pre": {"prepare_snapshot"}, "post": {"wake_after_restore"}}
    # The caches stay on Volumes either way: a snapshot holds memory, not the volumes' files.
    assert set(module.Server._get_class_service_function().info().volumes) == {
        module.HF_CACHE_DIR,
        module.VLLM_CACHE_DIR,
    }


def test_snapshot_off_has_neither(monkeypatch: pytest.MonkeyPatch) -> None:
    module, passed = load_recording_cls_options(monkeypatch, BUNDLE_MODAL_SNAPSHOT="false")
    assert "enable_memory_snapshot" not in passed and "experimental_options" not in passed
    assert enter_hooks(module) == {"pre": set(), "post": set()}


def test_snapshot_hooks_hand_modal_a_coroutine_only_in_a_container(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_modal_app(monkeypatch, BUNDLE_MODAL_SNAPSHOT="true", BUNDLE_MODEL="tiny")
    server = module.Server._get_user_cls()()
    # Locally (.local(), tests) nothing would run a coroutine: the hooks return none.
    assert modal.is_local()
    assert server.prepare_snapshot() is None
    assert server.wake_after_restore() is None
    assert server.lifecycle is not None and server.lifecycle.engine is None
    # In a container Modal runs what they return on its one loop; nothing is started here.
    monkeypatch.setattr(module.modal, "is_local", lambda: False)
    work = server.prepare_snapshot()
    assert asyncio.iscoroutine(work)
    work.close()


# --- several GPUs: Modal snapshots the GPU memory of single-GPU functions only --------------------
@pytest.mark.parametrize(
    ("spec", "count"),
    [("H200", 1), ("h100", 1), ("H100:2", 2), ("h100:2", 2), ("A100-80GB:4", 4), ("L40S:1", 1)],
)
def test_the_gpu_count_is_the_one_modal_parses(spec: str, count: int) -> None:
    assert ModalSettings(gpu=spec).gpu_count == count


def test_a_bad_gpu_count_stops_the_deploy_with_modals_reason() -> None:
    with pytest.raises(modal.exception.InvalidError, match="Invalid GPU count"):
        ModalSettings(gpu="H100:two").use_snapshots()


def test_several_gpus_deploy_without_snapshots_by_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="modal_app.app"):
        module, passed = load_recording_cls_options(monkeypatch, BUNDLE_MODAL_GPU="h100:2")
    assert module.Server._get_class_service_function().info().gpus == [("H100", 2)]
    assert "enable_memory_snapshot" not in passed and "experimental_options" not in passed
    assert enter_hooks(module) == {"pre": set(), "post": set()}
    # One line at deploy says why, naming the GPU spec.
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "h100:2" in warnings[0] and "\n" not in warnings[0]


def test_one_gpu_keeps_snapshots_and_says_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="modal_app.app"):
        module, passed = load_recording_cls_options(monkeypatch, BUNDLE_MODAL_GPU="A100-80GB")
    assert passed["enable_memory_snapshot"] is True
    assert enter_hooks(module) == {"pre": {"prepare_snapshot"}, "post": {"wake_after_restore"}}
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_snapshots_asked_for_with_several_gpus_refuse_the_deploy(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"^BUNDLE_MODAL_SNAPSHOT=true needs one GPU") as refused:
        load_modal_app(monkeypatch, BUNDLE_MODAL_GPU="A100-80GB:4", BUNDLE_MODAL_SNAPSHOT="true")
    assert "A100-80GB:4 asks for 4" in str(refused.value) and "\n" not in str(refused.value)
    # Turned off explicitly, several GPUs deploy, silently: the user chose it.
    module, passed = load_recording_cls_options(
        monkeypatch, BUNDLE_MODAL_GPU="H100:2", BUNDLE_MODAL_SNAPSHOT="false"
    )
    assert "enable_memory_snapshot" not in passed
    assert module.CONTAINER_ENV["BUNDLE_MODAL_SNAPSHOT"] == "false"


def test_the_web_app_is_built_before_the_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    # A restore then pays neither the web stack's imports nor building the app (0.72 s measured
    # by bench/modal_rehearsal.py on CPU when web() built it after the wake-up).
    module = load_modal_app(monkeypatch, BUNDLE_MODAL_SNAPSHOT="true", BUNDLE_MODEL="tiny")
    server = module.Server._get_user_cls()()
    assert server.web_app is None
    server.prepare_snapshot()
    assert server.web_app is not None and server.web_app.state.settings is module.SETTINGS
    assert server.web() is server.web_app
    # Without snapshots there is no hook: web() builds the app whose lifespan starts the engine.
    off = load_modal_app(monkeypatch, BUNDLE_MODAL_SNAPSHOT="false", BUNDLE_MODEL="tiny")
    plain = off.Server._get_user_cls()()
    assert plain.web_app is None and plain.web() is not plain.web()


def test_the_modal_app_serves_the_responses_api(served: LocalServer) -> None:
    """Issue 30: the Modal class's app is the same app, so /v1/responses works through it."""
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY, max_retries=0)
    created = client.responses.create(
        model="tiny", input="Say something.", max_output_tokens=12, temperature=0, background=True
    )
    assert created.status in {"queued", "in_progress"}
    deadline = time.monotonic() + 120
    while (current := client.responses.retrieve(created.id)).status in {"queued", "in_progress"}:
        assert time.monotonic() < deadline, "the background response did not end"
        time.sleep(0.2)
    assert current.status in {"completed", "incomplete"}  # the tiny model rarely stops on its own
    assert current.usage is not None and current.usage.output_tokens == 12
    assert current.output_text
