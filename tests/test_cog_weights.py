"""COG_WEIGHTS as Replicate uses it: a URL of a .tar of the model, fetched and unpacked at setup.

A real HTTP server (http.server in a thread) serves tars of the tiny model, once with Range
support and once without; shared/models/weights.py downloads them with its real httpx client. Failures
(404, truncated or corrupt archive, a member leading out, a full disk) must each be one
`WeightsUnavailable` that names the URL and what went wrong.
"""

from __future__ import annotations

import errno
import io
import os
import re
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cog_bridge as bridge
import httpx
import pytest

from shared.engine.vllm_startup import resolve_model_path
from shared.errors import WeightsUnavailable
from shared.models import weights
from shared.settings import Settings

SMALL_PART = 256 * 1024  # the tiny model's tar is a few MB: several parts of it


@dataclass
class Served:
    """What the test server holds and what it saw."""

    files: dict[str, bytes] = field(default_factory=dict)
    ranges: bool = True
    seen: list[str | None] = field(default_factory=list)  # the Range header of each GET
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # When set, the first ranged GETs (one per party) each wait here until all of them have
    # arrived: parts fetched side by side meet, parts fetched one after another never do (the
    # wait times out, the GET fails, and so does the download).
    side_by_side: threading.Barrier | None = None
    spans_seen: int = 0

    def must_meet(self, header: str | None) -> bool:
        """Whether this GET waits at `side_by_side` (call it holding the lock)."""
        if header is None or header == "bytes=0-0" or self.side_by_side is None:  # not a part
            return False
        self.spans_seen += 1
        return self.spans_seen <= self.side_by_side.parties


MEET_WITHIN_S = 60.0  # the parts' requests arrive together in milliseconds; this only ends a hang


def _handler(served: Served) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep pytest's output clean
            pass

        def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
            body = served.files.get(self.path)
            header = self.headers.get("Range")
            with served.lock:
                served.seen.append(header)
                served.in_flight += 1
                served.most_in_flight = max(served.most_in_flight, served.in_flight)
                meets = served.must_meet(header)
            try:
                if body is None:
                    self.send_error(404)
                    return
                if meets:
                    assert served.side_by_side is not None
                    served.side_by_side.wait(MEET_WITHIN_S)  # BrokenBarrierError: no answer
                self._send(body, header if served.ranges else None)
            finally:
                with served.lock:
                    served.in_flight -= 1

        def _send(self, body: bytes, header: str | None) -> None:
            match = re.fullmatch(r"bytes=(\d+)-(\d+)", header or "")
            if match is None:
                self.send_response(200)
                part, start = body, 0
            else:
                start, end = int(match.group(1)), min(int(match.group(2)), len(body) - 1)
                part = body[start : end + 1]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(body)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            for offset in range(0, len(part), 64 * 1024):
                self.wfile.write(part[offset : offset + 64 * 1024])

    return Handler


@pytest.fixture
def served() -> Iterator[tuple[Served, str]]:
    state = Served()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return Path(resolve_model_path(Settings()))  # built once, cached like every test's model


def make_tar(model: Path, *, top: str | None = "tiny-model", gz: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gz else "w") as tar:
        for path in sorted(model.iterdir()):
            tar.add(path, arcname=f"{top}/{path.name}" if top else path.name)
    return buffer.getvalue()


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / name).read_bytes() == (b / name).read_bytes() for name in names
    )


def fetch(url: str, cache: Path) -> Path:
    return weights.fetch_weights(url, cache, parts=4, min_part_bytes=SMALL_PART)


# --- downloads -------------------------------------------------------------------------------
def test_parallel_ranged_download_gives_identical_bytes(
    served: tuple[Served, str], tmp_path: Path, tiny_model: Path
) -> None:
    state, base = served
    state.files["/w.tar"] = archive = make_tar(tiny_model)
    assert len(archive) > 4 * SMALL_PART
    state.side_by_side = threading.Barrier(2)  # two parts must be in flight at once to be served
    with httpx.Client() as client:
        remote = weights._probe(client, f"{base}/w.tar")
        assert (remote.size, remote.ranges) == (len(archive), True)
        weights.download(client, remote, tmp_path / "w.tar", parts=4, min_part_bytes=SMALL_PART)
    assert (tmp_path / "w.tar").read_bytes() == archive
    spans = [h for h in state.seen if h != "bytes=0-0"]
    assert len(spans) == 4 and all(h and h.startswith("bytes=") for h in spans)
    assert state.most_in_flight >= 2  # the parts were fetched side by side (they met)


def test_a_server_without_ranges_gets_one_stream(
    served: tuple[Served, str], tmp_path: Path, tiny_model: Path
) -> None:
    state, base = served
    state.ranges = False
    state.files["/w.tar.gz"] = archive = make_tar(tiny_model, gz=True)
    with httpx.Client() as client:
        remote = weights._probe(client, f"{base}/w.tar.gz")
        assert (remote.size, remote.ranges) == (len(archive), False)
        weights.download(client, remote, tmp_path / "w", parts=4, min_part_bytes=SMALL_PART)
    assert (tmp_path / "w").read_bytes() == archive
    assert state.seen == ["bytes=0-0", None]  # the probe, then one plain GET


@pytest.mark.parametrize(("top", "gz"), [("tiny-model", False), (None, True)])
def test_runner_settings_name_the_unpacked_model_and_reuse_it(
    served: tuple[Served, str], tmp_path: Path, tiny_model: Path, top: str | None, gz: bool
) -> None:
    state, base = served
    url = f"{base}/model.tar" + (".gz" if gz else "")
    state.files[url[len(base) :]] = make_tar(tiny_model, top=top, gz=gz)
    settings = bridge.runner_settings(url, Settings(cache_dir=tmp_path))
    model = Path(settings.model)
    # vLLM is given a stable link, whatever the URL (its compile cache is keyed by the path)
    assert model.parent == tmp_path / "weights" and model.name.startswith(f"{weights.SERVED_LINK}-")
    assert model.resolve().is_relative_to(weights.cache_entry(url, tmp_path))
    assert same_files(model, tiny_model)
    requests = len(state.seen)
    again = bridge.runner_settings(url, Settings(cache_dir=tmp_path))
    assert again.model == settings.model and len(state.seen) == requests  # no second download


def test_local_paths_and_hub_ids_pass_through(tmp_path: Path) -> None:
    assert bridge.runner_settings(str(tmp_path), Settings(cache_dir=tmp_path)).model == str(tmp_path)
    hub_id = "meta-llama/Llama-3.1-8B-Instruct"
    assert weights.resolve_weights(hub_id, tmp_path) == hub_id
    assert bridge.runner_settings(None, Settings(model="org/m")).model == "org/m"
    assert not (tmp_path / "weights").exists()


def test_split_covers_every_byte_once() -> None:
    for size, parts, least in ((10, 3, 1), (1000, 8, 300), (5, 8, 1), (1, 4, 1), (10_000_019, 8, 1)):
        spans = weights.split(size, parts, least)
        assert spans[0][0] == 0 and spans[-1][1] == size - 1
        assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:], strict=False))
        assert len(spans) <= parts


# --- failures: one clear error naming the URL --------------------------------------------------
def test_bad_url_names_the_url_and_status(served: tuple[Served, str], tmp_path: Path) -> None:
    _, base = served
    with pytest.raises(WeightsUnavailable, match=rf"{re.escape(base)}/missing.tar: HTTP 404"):
        fetch(f"{base}/missing.tar", tmp_path)
    closed = f"http://127.0.0.1:{_closed_port()}/w.tar"
    with pytest.raises(WeightsUnavailable, match=re.escape(closed)):
        fetch(closed, tmp_path)


def _closed_port() -> int:
    from .conftest import free_port

    return free_port()


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "truncated-gz"])
def test_bad_archive(served: tuple[Served, str], tmp_path: Path, tiny_model: Path, damage: str) -> None:
    state, base = served
    archive = make_tar(tiny_model, gz=damage.endswith("gz"))
    state.files["/w.tar"] = {
        "truncated": archive[: len(archive) // 2],
        "truncated-gz": archive[: len(archive) // 2],
        "corrupt": os.urandom(len(archive)),
    }[damage]
    with pytest.raises(WeightsUnavailable, match=rf"{re.escape(base)}/w.tar.*(not a valid|not a readable)"):
        fetch(f"{base}/w.tar", tmp_path)
    entry = weights.cache_entry(f"{base}/w.tar", tmp_path)
    assert not (entry / weights.COMPLETE_MARKER).exists() and not (entry / "archive.part").exists()


@pytest.mark.parametrize("member", ["traversal", "symlink-out", "hardlink-out"])
def test_members_leading_out_are_refused(served: tuple[Served, str], tmp_path: Path, member: str) -> None:
    state, base = served
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("model/config.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
        bad = tarfile.TarInfo("../../evil" if member == "traversal" else "model/evil")
        if member == "traversal":
            bad.size = 4
        else:
            bad.type = tarfile.SYMTYPE if member == "symlink-out" else tarfile.LNKTYPE
            bad.linkname = "../../../../etc/passwd"
        tar.addfile(bad, io.BytesIO(b"evil") if bad.isfile() else None)
    state.files["/w.tar"] = buffer.getvalue()
    with pytest.raises(WeightsUnavailable, match=rf"{re.escape(base)}/w.tar has an unsafe member"):
        fetch(f"{base}/w.tar", tmp_path)
    assert not list(tmp_path.parent.rglob("evil"))  # nothing written, inside or out


def test_an_archive_without_a_model_is_refused(served: tuple[Served, str], tmp_path: Path) -> None:
    state, base = served
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("a/weights.bin", "b/notes.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    state.files["/w.tar"] = buffer.getvalue()
    with pytest.raises(WeightsUnavailable, match=r"holds no model: no config.json .*found: a, b"):
        fetch(f"{base}/w.tar", tmp_path)


def test_too_little_disk_is_refused_before_downloading(
    served: tuple[Served, str], tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, base = served
    state.files["/w.tar"] = make_tar(tiny_model)
    monkeypatch.setattr(weights, "free_bytes", lambda path: weights.DISK_MARGIN_BYTES)
    expected = rf"not enough disk for the weights at {re.escape(base)}/w.tar"
    with pytest.raises(WeightsUnavailable, match=expected):
        fetch(f"{base}/w.tar", tmp_path)
    assert state.seen == ["bytes=0-0"]  # the probe only: not one byte written


def test_a_disk_that_fills_up_midway_fails_clearly_and_leaves_no_complete_entry(
    served: tuple[Served, str], tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, base = served
    url = f"{base}/w.tar"
    state.files["/w.tar"] = archive = make_tar(tiny_model)
    real_pwrite, written = os.pwrite, [0]

    def filling_pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        if written[0] > len(archive) // 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(weights.os, "pwrite", filling_pwrite)
    expected = rf"disk filled up while downloading the weights at {re.escape(url)}"
    with pytest.raises(WeightsUnavailable, match=expected):
        fetch(url, tmp_path)
    monkeypatch.setattr(weights.os, "pwrite", real_pwrite)
    entry = weights.cache_entry(url, tmp_path)
    assert not (entry / weights.COMPLETE_MARKER).exists()
    # The next setup does not take the partial file for the weights: it downloads again.
    before = len(state.seen)
    model = fetch(url, tmp_path)
    assert len(state.seen) > before + 1 and same_files(model, tiny_model)


# --- the real Cog server, COG_WEIGHTS a URL ---------------------------------------------------------
def test_coglet_boots_the_runner_from_a_weights_url(
    served: tuple[Served, str], tmp_path: Path, tiny_model: Path
) -> None:
    """What Replicate does with a trained version: COG_WEIGHTS in the container's environment,
    coglet hands it to setup(), the runner fetches and serves it; progress is in the setup log."""
    from .test_cog import running_cog_server

    state, base = served
    state.files["/trained.tar"] = make_tar(tiny_model)
    url = f"{base}/trained.tar"
    log_path = tmp_path / "server.log"
    env = {"COG_WEIGHTS": url, "BUNDLE_CACHE_DIR": str(tmp_path / "cache"), "BUNDLE_MAX_MODEL_LEN": "512"}
    with running_cog_server(tmp_path, **env) as server:
        result = httpx.post(
            f"{server.url}/predictions", json={"input": {"prompt": "hi", "max_tokens": 4}}, timeout=60
        ).json()
        assert result["status"] == "succeeded", result
        assert result["metrics"]["output_token_count"] >= 1
    assert "bytes=0-0" in state.seen  # the runner fetched the tar itself
    model = weights.cache_entry(url, tmp_path / "cache") / "files" / "tiny-model"
    assert same_files(model, tiny_model)
    assert "weights: " in log_path.read_text(), log_path.read_text()[-3000:]
