"""vLLM's model-class inspection begun early (shared/engine/model_inspection.py): a real child
interpreter with the real vLLM registry fills vLLM's own cache, which the registry in this process
then answers from; a warm cache starts nothing; a failing or unneeded child is one log line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from shared.engine import model_inspection
from shared.engine.model_inspection import begin_inspection, settle_inspection
from shared.models.tiny_model import ensure_model
from shared.settings import Settings

ARCH = "LlamaForCausalLM"


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "vllm-cache"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    return root


@pytest.fixture
def model_dir() -> Path:
    settings = Settings()
    return ensure_model(settings.cache_dir, settings.tiny_model_shape, settings.tiny_model_seed)


def _answers(root: Path) -> list[Path]:
    return sorted((root / "modelinfos").glob(f"*-{ARCH}.json"))


@pytest.mark.slow
def test_the_early_inspection_answers_vllms_registry_in_this_process(
    cache_root: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shared.engine.model_inspection")
    begin_inspection(model_dir)
    settle_inspection()
    assert "done early" in caplog.text
    [answer] = _answers(cache_root)
    assert json.loads(answer.read_text())["hash"]
    # The engine's configuration asks the registry; with the answer cached it starts no process.
    from vllm.model_executor.models import registry

    def no_subprocess(work: object) -> None:
        raise AssertionError("the registry inspected the class again")

    monkeypatch.setattr(registry, "_run_in_subprocess", no_subprocess)
    info = registry.ModelRegistry.models[ARCH].inspect_model_cls()
    assert info.architecture == ARCH


def test_a_warm_cache_or_a_model_without_config_starts_nothing(
    cache_root: Path, model_dir: Path, tmp_path: Path
) -> None:
    (cache_root / "modelinfos").mkdir(parents=True)
    (cache_root / "modelinfos" / f"vllm-model_executor-models-llama-{ARCH}.json").write_text("{}")
    begin_inspection(model_dir)
    assert model_inspection._pending == []
    begin_inspection(tmp_path / "no-such-model")
    begin_inspection("meta-llama/Llama-3.1-8B-Instruct")  # an id: the engine resolves it
    assert model_inspection._pending == []
    settle_inspection()  # nothing to settle is no error


def test_a_child_that_fails_is_one_warning_and_the_start_goes_on(
    cache_root: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    failing = "import sys; print('registry gone', file=sys.stderr); sys.exit(3)"
    monkeypatch.setattr(model_inspection, "CHILD", failing)
    begin_inspection(model_dir)
    settle_inspection()
    assert "the early one failed (exit 3: registry gone); the engine will do it" in caplog.text
    assert _answers(cache_root) == []


def test_a_pack_that_brought_the_answer_keeps_it_even_when_the_child_ended_first(
    cache_root: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shared.engine.model_inspection")
    child_answers = (  # the child's own answer, written into its scratch root, then it exits
        "import os, pathlib; folder = pathlib.Path(os.environ['VLLM_CACHE_ROOT'], 'modelinfos'); "
        f"folder.mkdir(parents=True); (folder / 'm-{ARCH}.json').write_text('child')"
    )
    monkeypatch.setattr(model_inspection, "CHILD", child_answers)
    begin_inspection(model_dir)
    [inspection] = model_inspection._pending
    inspection.process.wait()
    assert (inspection.scratch / "modelinfos" / f"m-{ARCH}.json").read_text() == "child"
    assert not (cache_root / "modelinfos").exists()  # nothing written where the engine reads
    (cache_root / "modelinfos").mkdir(parents=True)  # then the pack's unpacking
    pack_answer = cache_root / "modelinfos" / f"m-{ARCH}.json"
    pack_answer.write_text("pack")
    settle_inspection()
    assert pack_answer.read_text() == "pack"
    assert f"{ARCH} already in the cache" in caplog.text
    assert not inspection.scratch.exists()


def test_an_answer_that_a_pack_brought_stops_the_child_without_waiting(
    cache_root: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shared.engine.model_inspection")
    monkeypatch.setattr(model_inspection, "CHILD", "import time; time.sleep(600)")  # never ends by itself
    begin_inspection(model_dir)
    [inspection] = model_inspection._pending
    (cache_root / "modelinfos").mkdir(parents=True)  # what unpacking a pack puts there
    (cache_root / "modelinfos" / f"vllm-model_executor-models-llama-{ARCH}.json").write_text("{}")
    settle_inspection()
    assert inspection.process.returncode is not None  # stopped, not waited 600 s for
    assert not inspection.scratch.exists()
    assert f"{ARCH} already in the cache; the early one stopped" in caplog.text
