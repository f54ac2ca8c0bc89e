"""The Cog runner's start-up inside coglet's worker (issue 28), against the real coglet 0.23.1.

On the H200, vLLM 0.26 forks its engine core from coglet's worker, and the core died at once:
its first step sets attributes on `sys.stdout`/`sys.stderr`, which coglet had replaced by Rust
objects that take none, and what the core wrote went through copies of those objects whose
reading threads do not exist after fork, so its cause reached no log. vLLM's CPU build spawns
its core instead (its platform forces it), so here a test-only runner forks a child that starts
the way that core does (tests/cog_fork_runner.py), after loading the real runner module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import child_output
import httpx
import pytest

from .conftest import free_port
from .test_cog import ROOT, _launch, _stop

FORK_RUNNER = f"{ROOT / 'tests' / 'cog_fork_runner.py'}:Runner"


def _wait_for_setup(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> str:
    """READY or SETUP_FAILED, as soon as coglet says so; never waits on a dead server."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            status = str(httpx.get(f"{url}/health-check", timeout=5).json()["status"])
        except (httpx.HTTPError, ValueError, KeyError):
            status = "STARTING"
        if status in ("READY", "SETUP_FAILED"):
            return status
        time.sleep(0.3)
    return "NO ANSWER" if process.poll() is None else f"exited {process.returncode}"


def coglet_messages(log_path: Path) -> str:
    """Every message in coglet's JSON log (its own and what it captured), one per line."""
    messages = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            messages.append(str(json.loads(line)["fields"]["message"]))
        except (ValueError, KeyError, TypeError):
            messages.append(line)
    return "\n".join(messages)


@pytest.mark.timeout(120)
def test_a_forked_engine_child_starts_like_vllm_and_its_output_reaches_coglets_log(tmp_path: Path) -> None:
    """Fails without the runner's fork hook (cog/child_output.py): the child dies on the
    stream decoration (AttributeError) and not one of its lines reaches coglet's log."""
    from tests.cog_fork_runner import MARKER  # a constant; importing the runner here is harmless

    port = free_port()
    log_path = tmp_path / "server.log"
    process = _launch(FORK_RUNNER, port, log_path, ROOT, {"COG_MAX_CONCURRENCY": "1"})
    expected = [
        # The coglet fact behind the H200's failure: its stream objects take no attributes.
        "coglet's sys.stdout takes no attributes: AttributeError",
        # The decoration worked (the prefix) and every way the child wrote reached the log.
        f"(EngineCore) {MARKER} via the logging handler",
        f"(EngineCore) {MARKER} via print",
        f"RuntimeError: {MARKER} failing on purpose",
        "forked from coglet's worker",  # the hook's own line, from the child
    ]
    try:
        status = _wait_for_setup(f"http://127.0.0.1:{port}", process, timeout_s=90)
        # Coglet writes the captured lines as its capture threads forward them, maybe after it
        # said SETUP_FAILED: wait for them (bounded) before stopping it.
        _wait_for_lines(log_path, expected, process, timeout_s=30)
    finally:
        _stop(process)
    log = coglet_messages(log_path)
    assert status == "SETUP_FAILED", log[-3000:]
    for line in expected:
        assert line in log, f"{line!r} not in coglet's log:\n{log[-3000:]}"


def _wait_for_lines(
    log_path: Path, lines: list[str], process: subprocess.Popen[bytes], timeout_s: float
) -> None:
    """Until every line is in coglet's log, the server exits or `timeout_s` passes (the caller
    then says which line is missing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        log = coglet_messages(log_path)
        if all(line in log for line in lines):
            return
        time.sleep(0.05)


def test_the_hook_is_only_for_coglets_worker() -> None:
    """Outside coglet (the HTTP server, the tests, `make cog-schema`) nothing is registered."""
    assert child_output.give_forked_children_plain_streams(under_coglet=False) is False
    assert child_output._state["installed"] is False


CHILD_SCRIPT = """
import logging, multiprocessing, sys
import child_output


class SlotWriter:  # like coglet's: no __dict__, and its lines never leave a forked child
    __slots__ = ()

    def write(self, text):
        return len(text)

    def flush(self):
        pass


sys.stdout, sys.stderr = SlotWriter(), SlotWriter()
handler = logging.StreamHandler(sys.stdout)
logging.getLogger("vllm").addHandler(handler)
assert child_output.give_forked_children_plain_streams(under_coglet=True)
assert not child_output.give_forked_children_plain_streams(under_coglet=True)  # once


def child():
    sys.stdout.start_new_line = True  # vLLM 0.26's decorate_logs()
    logging.getLogger("vllm").error("via the handler")
    print("via print")


process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join()
sys.exit(process.exitcode)
"""


def test_a_forked_child_gets_streams_on_its_descriptors_and_the_handlers_follow() -> None:
    """Without coglet: a parent whose streams are coglet-like objects; the child's lines reach
    the real descriptors 1 and 2, the logging handler's included."""
    # child_output sits beside cog/predict.py (not a package: `import cog` is the Cog SDK).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "cog"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", CHILD_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["via the handler", "via print"]
    assert "forked from coglet's worker" in done.stderr


def test_the_rehearsal_puts_this_interpreter_on_path_as_python(tmp_path: Path) -> None:
    """coglet starts its worker as `python` from PATH; on the H200 only `python3` exists."""
    from bench.cog_rehearsal import python_on_path

    env = python_on_path(tmp_path / "bin")
    shown = subprocess.run(
        ["python", "-c", "import sys, shared; print(sys.executable); print(shared.__file__)"],
        env={"PATH": env["PATH"]},  # nothing else: the script carries PYTHONPATH itself
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert shown[0] == sys.executable and shown[1].startswith(str(ROOT))


def test_the_rehearsal_refuses_bad_counts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.cog_rehearsal", "--out", "/tmp/unused", "--concurrency", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--concurrency must be at least 1" in done.stderr


def test_the_rehearsal_splits_vllms_jit_warnings_at_ready() -> None:
    """The H200's first Cog runs (committed logs): the top-k/top-p kernel compiled after READY,
    in the first 32-prediction wave; the rehearsal's JSON says so, and where it happened."""
    from bench.cog_rehearsal import jit_compiles

    runs = ROOT / "results" / "h200" / "cog"
    for run in ("run1", "run2"):
        assert (runs / run / "coglet.log").is_file()  # jit_compiles reads a missing log as no compile
        found = jit_compiles(runs / run / "coglet.log")
        assert found == {"setup": [], "after_ready": ["_topk_topp_kernel"]}, (run, found)
    # The runner with setup()'s sampler warm-up (issue 28's last H200 run): compiled before READY.
    found = jit_compiles(runs / "run4-current" / "coglet.log")
    assert found == {"setup": ["_topk_topp_kernel"], "after_ready": []}, found
