"""What the Cog runner uses of coglet's internals (cog/coglet_internals.py) is found in the installed
coglet, the release cog.yaml and pyproject pin: an upgrade that renames coglet's run() wrapper or
its locals fails here. A coglet without them is made by changing a copy of its extension (one
without the wrapper cannot be installed beside the pinned one): the check then reports the
fallback, and a submission is passed on untouched, as cog/cog_cancel.py's fallback does. The
runner reporting it under the real coglet: tests/test_cog.py."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

coglet = pytest.importorskip("coglet")  # the Python 3.12 run installs no Cog

import cog_cancel  # noqa: E402
import coglet_internals  # noqa: E402

from shared.obs.internals_check import InternalsCheck  # noqa: E402
from shared.obs.metrics import Metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FEATURES = {"run_submit", "run_wrapper", "cancel_hook"}


def path_of(check: InternalsCheck, feature: str) -> tuple[str, str]:
    (found,) = [f for f in check.found if f.feature == feature]
    return found.path, found.kind


async def _ctx_wrapper(coro: Any, prediction_id: str, *context: object) -> Any:
    """Shaped as coglet 0.23.1's wrapper around run() (its name and the locals the runner reads)."""
    return await coro


async def _other_wrapper(coro: Any, prediction_id: str) -> Any:
    """A coglet whose wrapper has another name."""
    return await coro


async def _run() -> str:
    return "the generator"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread, as coglet's worker runs the runner's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


# --- the pinned release -------------------------------------------------------------------------------
def test_the_pinned_coglet_takes_no_fallback_path() -> None:
    check = coglet_internals.detect(hook_installed=True)
    assert {f.feature for f in check.found} == FEATURES
    assert check.fallbacks() == (), check.log_line()
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cog"]
    assert extra == [f"cog=={coglet.__version__}"]  # the Cog SDK's release is coglet's
    assert check.releases == (f"coglet {coglet.__version__}",)


def test_the_check_is_one_line_and_a_series_per_use(caplog: pytest.LogCaptureFixture) -> None:
    check = coglet_internals.detect(hook_installed=True)
    with caplog.at_level(logging.INFO, logger="coglet_internals"):
        coglet_internals.log_found(check)
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        f"coglet internals: coglet {coglet.__version__}: coglet.run_submit=run_coroutine_threadsafe, "
        "coglet.run_wrapper=_ctx_wrapper, coglet.cancel_hook=installed"
    )
    metrics = Metrics()
    metrics.show_server_features(check.found)
    text = metrics.exposition().decode()
    assert 'bundle_server_features{component="coglet",feature="run_wrapper",path="_ctx_wrapper"} 1.0' in text
    assert text.count("bundle_server_features{") == len(FEATURES)


def test_a_submission_is_read_through_coglets_wrapper() -> None:
    run = _run()
    wrapper = _ctx_wrapper(run, "prediction-1", None)
    assert coglet_internals.is_run(wrapper)
    assert coglet_internals.wrapped_run(wrapper) is run
    assert coglet_internals.prediction_id(wrapper) == "prediction-1"
    other = _run()
    assert not coglet_internals.is_run(other) and coglet_internals.wrapped_run(other) is None
    for coro in (wrapper, run, other):
        coro.close()


# --- a coglet without them ------------------------------------------------------------------------------
@pytest.fixture
def renamed_wrapper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of coglet's extension whose wrapper has another name (same length), checked in its place."""
    copy = tmp_path / "_impl.abi3.so"
    shutil.copyfile(coglet_internals.extension_path(), copy)
    image = copy.read_bytes()
    assert image.count(coglet_internals.RUN_WRAPPER_SOURCE) == 1
    copy.write_bytes(image.replace(b"async def _ctx_wrapper(", b"async def _run_wrapper("))
    monkeypatch.setattr(coglet_internals, "extension_path", lambda: copy)
    return copy


def test_each_check_reports_a_fallback_when_its_member_is_missing(renamed_wrapper: Path) -> None:
    check = coglet_internals.detect(hook_installed=False)
    assert path_of(check, "run_wrapper") == ("unknown", "fallback")
    assert path_of(check, "cancel_hook") == ("not_installed", "fallback")
    assert path_of(check, "run_submit") == ("run_coroutine_threadsafe", "expected")
    assert {f.feature for f in check.fallbacks()} == {"run_wrapper", "cancel_hook"}


def test_a_fallback_is_a_warning_naming_it(renamed_wrapper: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="coglet_internals"):
        coglet_internals.log_found(coglet_internals.detect(hook_installed=True))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "(fallbacks: coglet.run_wrapper)" in record.getMessage()
    assert "coglet.run_wrapper=unknown (fallback)" in record.getMessage()


def test_a_wrapper_of_another_name_is_submitted_untouched(loop: asyncio.AbstractEventLoop) -> None:
    """The fallback: not taken for a run, so no cancel signal; run() still runs and answers."""
    submitted = cog_cancel.submit_with_cancel_signal(_other_wrapper(_run(), "prediction-2"), loop)
    assert not isinstance(submitted, cog_cancel.CogletRun)
    assert submitted.result(10) == "the generator"
    taken = cog_cancel.submit_with_cancel_signal(_ctx_wrapper(_run(), "prediction-3"), loop)
    assert isinstance(taken, cog_cancel.CogletRun)
    assert taken.result(10) == "the generator"
