"""The Modal rehearsal runs a class the way Modal 1.6.4's container does: hooks found by Modal's
own flags, in Modal's order, every coroutine on one loop. Offline and fast: a recording class
built with Modal's decorators stands where the real one's engine would start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import httpx
import modal
import pytest
from fastapi import FastAPI

from bench.modal_container import PHASES, ContainerRecorder, run_container
from bench.modal_rehearsal import hook_names
from tests.test_modal_app import load_modal_app

CALLS: list[tuple[str, int | None]] = []  # what ran, and the id of the loop it ran on (None: no loop)


def on_loop(what: str) -> Coroutine[Any, Any, None]:
    async def record() -> None:
        CALLS.append((what, id(asyncio.get_running_loop())))

    return record()


def running_loop() -> int | None:
    try:
        return id(asyncio.get_running_loop())
    except RuntimeError:
        return None


recording_app = modal.App("rehearsal-test")


@recording_app.cls(enable_memory_snapshot=True, serialized=True)
class Recording:
    # Shaped as modal_app.app.Server's hooks: plain functions returning the coroutine to run.
    @modal.enter(snap=True)
    def before_snapshot(self) -> Coroutine[Any, Any, None]:
        CALLS.append(("is_local", int(modal.is_local())))
        return on_loop("enter_pre_snapshot")

    @modal.enter(snap=False)
    def after_restore(self) -> Coroutine[Any, Any, None]:
        return on_loop("enter_post_snapshot")

    @modal.asgi_app()
    def web(self) -> FastAPI:
        CALLS.append(("asgi_app", running_loop()))

        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            CALLS.append(("lifespan_startup", running_loop()))
            yield
            CALLS.append(("lifespan_shutdown", running_loop()))

        app = FastAPI(lifespan=lifespan)

        @app.get("/ping")
        async def ping() -> dict[str, str]:
            CALLS.append(("request", running_loop()))
            return {"ok": "yes"}

        return app

    @modal.exit()
    def stop(self) -> Coroutine[Any, Any, None]:
        return on_loop("exit")


async def one_request(app: FastAPI) -> int:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://container") as client:
        return (await client.get("/ping")).status_code


@pytest.mark.parametrize("snapshots", [True, False])
def test_hooks_run_in_modals_order_on_one_loop(snapshots: bool) -> None:
    CALLS.clear()
    recorder = ContainerRecorder(on_snapshot=lambda: CALLS.append(("snapshot", running_loop())))
    with run_container(Recording, recorder, snapshots=snapshots) as container:
        assert container.loop.run(one_request(container.asgi_app)) == 200
        serving_loop = id(container.loop.loop)

    expected = ["is_local", "enter_pre_snapshot", "snapshot", "enter_post_snapshot", "asgi_app"]
    expected += ["lifespan_startup", "request", "lifespan_shutdown", "exit"]
    if not snapshots:
        expected.remove("snapshot")
    assert [what for what, _ in CALLS] == expected
    loops = dict(CALLS)
    assert loops.pop("is_local") == 0  # the hooks see a container: modal.is_local() is False
    # Every coroutine ran on the container's one loop; Modal calls the snapshot and the
    # asgi_app method synchronously, between runs of that loop.
    assert loops.pop("snapshot", None) is None and loops.pop("asgi_app") is None
    assert set(loops.values()) == {serving_loop}
    assert recorder.order_problems(snapshots) == []
    assert [p.name for p in recorder.phases] == list(PHASES)
    assert recorder.leftover_tasks == []
    assert modal.is_local()  # and a local process again afterwards


def test_a_failing_hook_stops_the_container_and_propagates() -> None:
    app = modal.App("rehearsal-failing")

    @app.cls(serialized=True)
    class Failing:
        @modal.enter(snap=False)
        def boom(self) -> None:
            raise RuntimeError("wake-up failed")

        @modal.asgi_app()
        def web(self) -> FastAPI:
            return FastAPI()

    recorder = ContainerRecorder()
    with pytest.raises(RuntimeError, match="wake-up failed"):
        with run_container(Failing, recorder, snapshots=False):
            pytest.fail("the container served after a failed enter hook")
    assert [p.name for p in recorder.phases] == ["enter_pre_snapshot", "enter_post_snapshot"]
    assert modal.is_local()


def test_the_rehearsal_finds_the_real_classs_hooks_by_modals_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    on = load_modal_app(monkeypatch, BUNDLE_MODAL_SNAPSHOT="true", BUNDLE_MODEL="tiny")
    assert hook_names(on.Server) == {
        "enter_pre_snapshot": ["prepare_snapshot"],
        "enter_post_snapshot": ["wake_after_restore"],
        "asgi_app": ["web"],
        "exit": ["stop"],
    }
    off = load_modal_app(monkeypatch, BUNDLE_MODAL_SNAPSHOT="false", BUNDLE_MODEL="tiny")
    assert hook_names(off.Server) == {
        "enter_pre_snapshot": [],
        "enter_post_snapshot": [],
        "asgi_app": ["web"],
        "exit": ["stop"],
    }
