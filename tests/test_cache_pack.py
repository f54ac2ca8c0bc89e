"""Compile-cache packs (shared/cache/): made from a root, used only where made for, never fatal.

Most tests build a root of cache-like files and a key by hand, then pack, damage and unpack it:
every refusal must be one log line naming the reason, leave the root as it was and let the
start go on. The last ones run the real thing: `python -m shared.serve` (vLLM's CPU build, the
tiny model) fills a root, `python -m shared.cache pack` packs it, and a second server started
from an emptied root with the pack finds vLLM's model-class cache in place and leaves it alone.
A start that goes on past a damaged pack is tests/test_cog_pack.py's (the real coglet).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from shared.cache import layout
from shared.cache.__main__ import main as cli
from shared.cache.layout import RECORD, read_record, write_record
from shared.cache.manifest import CACHES_DIR, MANIFEST_NAME, StartKey
from shared.cache.pack import STAGING_PREFIX, unpack_into, write_pack
from shared.cache.start import apply_pack, fetch_pack, use_compile_caches
from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "torch_compile_cache/abc123/rank_0_0/backbone/artifact.bin": os.urandom(200_000),
    "modelinfos/LlamaForCausalLM-0f.json": b'{"architecture": "LlamaForCausalLM"}',
    "triton/X7Q/_topk_topp_kernel.cubin": os.urandom(30_000),
    "inductor/fxgraph/aa/entry": b"graph",
}


def key_for(root: Path, **changes: Any) -> StartKey:
    key = StartKey(
        device="NVIDIA H200",
        compute_capability="9.0",
        python="3.12",
        packages={"vllm": "0.26.0", "torch": "2.11.0+cu130", "triton": "3.5.0", "flashinfer": None},
        model="/tmp/bundle-cache/weights/served-model",
        model_config_sha256="0" * 64,
        engine={"dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 256, "enforce_eager": False},
        root=str(root),
    )
    return key.model_copy(update=changes)


def fill(root: Path, files: dict[str, bytes] = FILES) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def contents(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name != RECORD
    }


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, Path, StartKey]:
    """(root, pack, key): a filled root, packed, then emptied as in a new container."""
    root = tmp_path / "root"
    fill(root)
    key = key_for(root)
    write_record(root, key)
    pack = tmp_path / "pack.tar"
    write_pack(root, pack, key, "2026-12-02T00:00:00+00:00")
    shutil.rmtree(root)
    return root, pack, key


def refused_once(caplog: pytest.LogCaptureFixture, source: Path | str, root: Path, key: StartKey) -> str:
    """Apply a pack that must be refused: one warning line, the root untouched; the line."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shared.cache"):
        assert apply_pack(str(source), root.parent, root, key) is False
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("shared.cache")]
    assert len(lines) == 1 and caplog.records[-1].levelno == logging.WARNING, lines
    assert lines[0].startswith(f"compile-cache pack {source}: not used, ") and lines[0].endswith(
        "; starting without it"
    )
    assert not root.exists() or contents(root) == {}, "a refused pack wrote into the root"
    assert not list(root.glob(f"{STAGING_PREFIX}*")) if root.exists() else True
    return lines[0]


# --- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["pack.tar", "pack.tar.gz"])
def test_pack_and_unpack_round_trip(tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    fill(root)
    key = key_for(root)
    write_record(root, key)
    pack = tmp_path / name
    written = write_pack(root, pack, key, "now")
    assert (written.files, written.bytes) == (len(FILES), sum(map(len, FILES.values())))
    with tarfile.open(pack) as tar:
        names = tar.getnames()
    assert names[0] == MANIFEST_NAME and f"{CACHES_DIR}/{RECORD}" not in names  # the key is the manifest's
    shutil.rmtree(root)
    with caplog.at_level(logging.INFO, logger="shared.cache"):
        assert apply_pack(str(pack), tmp_path, root, key) is True
    assert contents(root) == FILES
    assert f"used, {len(FILES)} files" in caplog.text
    assert not list(root.glob(f"{STAGING_PREFIX}*"))


def test_a_root_keeps_its_own_files_and_gains_the_missing_ones(packed: tuple[Path, Path, StartKey]) -> None:
    root, pack, key = packed
    fill(root, {"modelinfos/LlamaForCausalLM-0f.json": b"the root's own"})
    done = unpack_into(pack, root, key)
    assert (done.files, done.new_files) == (len(FILES), len(FILES) - 1)
    assert contents(root) == {**FILES, "modelinfos/LlamaForCausalLM-0f.json": b"the root's own"}


def test_an_unpacked_pack_folder_is_used_like_the_tar(
    tmp_path: Path, packed: tuple[Path, Path, StartKey]
) -> None:
    root, pack, key = packed
    folder = tmp_path / "cache"  # as it arrives inside Cog's weights tar
    folder.mkdir()
    with tarfile.open(pack) as tar:
        tar.extractall(folder, filter="data")
    assert apply_pack(str(folder), tmp_path, root, key) is True
    assert contents(root) == FILES
    assert (folder / MANIFEST_NAME).is_file()  # the source is copied from, not consumed


def test_a_start_like_the_recorded_one_does_not_unpack_again(
    packed: tuple[Path, Path, StartKey], caplog: pytest.LogCaptureFixture
) -> None:
    root, pack, key = packed
    write_record(root, key)  # a warm root (Modal's volume after its first container)
    with caplog.at_level(logging.INFO, logger="shared.cache"):
        assert apply_pack(str(pack), pack.parent, root, key) is False
    assert "not needed" in caplog.text and contents(root) == {}


# --- refusals: one line, the root untouched ------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("engine", {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 256, "enforce_eager": False},
         "engine.max_model_len: pack 4096, here 2048"),
        ("device", "NVIDIA H100 80GB HBM3", "device: pack 'NVIDIA H200', here 'NVIDIA H100 80GB HBM3'"),
        ("packages", {"vllm": "0.26.1", "torch": "2.11.0+cu130", "triton": "3.5.0", "flashinfer": None},
         "packages.vllm: pack '0.26.0', here '0.26.1'"),
        ("model", "/elsewhere/model", "model: pack"),
    ],
)  # fmt: skip
def test_a_pack_made_for_another_start_is_refused(
    packed: tuple[Path, Path, StartKey], caplog: pytest.LogCaptureFixture, field: str, value: Any, said: str
) -> None:
    root, pack, key = packed
    line = refused_once(caplog, pack, root, key.model_copy(update={field: value}))
    assert "made for another start" in line and said in line, line


def test_a_pack_for_another_root_is_refused(
    packed: tuple[Path, Path, StartKey], caplog: pytest.LogCaptureFixture
) -> None:
    root, pack, key = packed
    elsewhere = root.parent / "other-root"
    line = refused_once(caplog, pack, elsewhere, key.model_copy(update={"root": str(elsewhere)}))
    assert f"root: pack '{root}', here '{elsewhere}'" in line


def _rewrite(pack: Path, out: Path, change: Any) -> Path:
    """A copy of `pack` with its members passed through `change(info, data) -> [(info, data)]`."""
    with tarfile.open(pack) as source, tarfile.open(out, "w") as target:
        for info in source.getmembers():
            reader = source.extractfile(info)
            data = reader.read() if reader else b""
            for new_info, new_data in change(info, data):
                new_info.size = len(new_data)
                target.addfile(new_info, io.BytesIO(new_data) if new_info.isfile() else None)
    return out


def _flip_a_byte(info: tarfile.TarInfo, data: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    if info.name.endswith("artifact.bin"):
        data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    return [(info, data)]


def _drop_one(info: tarfile.TarInfo, data: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    return [] if info.name.endswith(".cubin") else [(info, data)]


def _add(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> Any:
    def change(info: tarfile.TarInfo, data: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
        if info.name != MANIFEST_NAME:
            return [(info, data)]
        extra = tarfile.TarInfo(name)
        extra.type, extra.linkname = kind, link
        return [(info, data), (extra, b"evil" if kind == tarfile.REGTYPE else b"")]

    return change


def _manifest(edit: Any) -> Any:
    def change(info: tarfile.TarInfo, data: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
        return [(info, edit(data) if info.name == MANIFEST_NAME else data)]

    return change


def _manifest_not_first(pack: Path, out: Path) -> Path:
    with tarfile.open(pack) as source, tarfile.open(out, "w") as target:
        members = source.getmembers()
        for info in members[1:] + members[:1]:
            target.addfile(info, source.extractfile(info))
    return out


DAMAGE = {
    "truncated": (lambda p, o: _cut(p, o, 0.5), "damaged or cut short"),
    "truncated-gz": (lambda p, o: _cut(_gzip(p, o.with_suffix(".full.gz")), o, 0.6), "damaged or cut short"),
    "random-bytes": (lambda p, o: _write(o, os.urandom(p.stat().st_size)), "not a readable .tar/.tar.gz"),
    "empty": (lambda p, o: _write(o, b""), "not a readable .tar/.tar.gz"),
    "flipped-byte": (lambda p, o: _rewrite(p, o, _flip_a_byte), "does not match its SHA-256: damaged"),
    "missing-file": (lambda p, o: _rewrite(p, o, _drop_one), "missing (first: triton/"),
    "extra-file": (lambda p, o: _rewrite(p, o, _add(f"{CACHES_DIR}/triton/extra")), "is not in its manifest"),
    "traversal": (lambda p, o: _rewrite(p, o, _add(f"{CACHES_DIR}/../../evil")), "unsafe member"),
    "absolute": (lambda p, o: _rewrite(p, o, _add("/tmp/evil-absolute")), "outside caches/"),
    "outside-caches": (lambda p, o: _rewrite(p, o, _add("evil.txt")), "outside caches/"),
    "symlink": (lambda p, o: _rewrite(p, o, _add(f"{CACHES_DIR}/ln", tarfile.SYMTYPE, "/etc/x")), "a link"),
    "hardlink": (lambda p, o: _rewrite(p, o, _add(f"{CACHES_DIR}/h", tarfile.LNKTYPE, "x")), "a link"),
    "manifest-not-first": (_manifest_not_first, "first member is not manifest.json"),
    "manifest-not-json": (lambda p, o: _rewrite(p, o, _manifest(lambda d: b"{not json")), "is malformed"),
    "manifest-wrong-schema": (
        lambda p, o: _rewrite(p, o, _manifest(lambda d: d.replace(b"bundle-compile-cache/1", b"other/9"))),
        "manifest.json is malformed (schema",
    ),
}  # fmt: skip


def _cut(pack: Path, out: Path, share: float) -> Path:
    return _write(out, pack.read_bytes()[: int(pack.stat().st_size * share)])


def _gzip(pack: Path, out: Path) -> Path:
    import gzip

    return _write(out, gzip.compress(pack.read_bytes()))


def _write(out: Path, data: bytes) -> Path:
    out.write_bytes(data)
    return out


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_or_unsafe_pack_is_refused_in_one_line(
    packed: tuple[Path, Path, StartKey], caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    root, pack, key = packed
    make, said = DAMAGE[damage]
    bad = make(pack, pack.with_name(f"bad-{damage}.tar"))
    line = refused_once(caplog, bad, root, key)
    assert said in line, line
    assert not list(Path("/tmp").glob("evil-absolute")) and not list(root.parent.parent.rglob("evil"))


def test_a_pack_folder_with_a_link_is_refused(
    tmp_path: Path, packed: tuple[Path, Path, StartKey], caplog: pytest.LogCaptureFixture
) -> None:
    root, pack, key = packed
    folder = tmp_path / "cache"
    folder.mkdir()
    with tarfile.open(pack) as tar:
        tar.extractall(folder, filter="data")
    (folder / CACHES_DIR / "triton" / "passwd").symlink_to("/etc/passwd")
    assert "is a link or a device" in refused_once(caplog, folder, root, key)


def test_a_missing_pack_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    assert "does not exist" in refused_once(caplog, tmp_path / "nowhere.tar", root, key_for(root))


def test_an_unexpected_failure_is_still_one_line(
    packed: tuple[Path, Path, StartKey], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, pack, key = packed

    def broken(*args: Any) -> Any:
        raise RuntimeError("something nobody foresaw")

    monkeypatch.setattr("shared.cache.start.unpack_into", broken)
    assert "unexpected RuntimeError: something nobody foresaw" in refused_once(caplog, pack, root, key)


# --- from a URL ---------------------------------------------------------------------------------------
@pytest.fixture
def http_files() -> Iterator[tuple[dict[str, bytes], str]]:
    files: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            # "/short": announce more than is sent, as a connection cut mid-body does
            self.send_header("Content-Length", str(len(body) + (1000 if self.path == "/short" else 0)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield files, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_pack_from_a_url_is_downloaded_and_used(
    packed: tuple[Path, Path, StartKey],
    http_files: tuple[dict[str, bytes], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, pack, key = packed
    files, base = http_files
    files["/pack.tar"] = files["/short"] = pack.read_bytes()
    with caplog.at_level(logging.INFO, logger="shared.cache"):
        assert apply_pack(f"{base}/pack.tar", root.parent, root, key) is True
    assert contents(root) == FILES
    shutil.rmtree(root)
    assert "HTTP 404" in refused_once(caplog, f"{base}/missing.tar", root, key)
    assert "downloading it failed" in refused_once(caplog, f"{base}/short", root, key)


# --- the start's hook ---------------------------------------------------------------------------------
class Args:
    """What `start_key` reads of vLLM's AsyncEngineArgs."""

    def __init__(self, model: str, **flags: Any) -> None:
        self.model = model
        self.__dict__.update(flags)


def test_without_a_root_the_caches_stay_where_they_are(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in layout.cache_env("/x"):
        monkeypatch.delenv(name, raising=False)
    assert use_compile_caches(Settings(cache_dir=tmp_path), Args("m")) is None
    assert not any(name in os.environ for name in layout.cache_env("/x"))


def test_a_pack_setting_gives_a_root_the_caches_point_at_and_records_the_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for name in layout.cache_env("/x"):
        monkeypatch.setenv(name, "before")  # restored after the test
    settings = Settings(cache_dir=tmp_path, compile_cache=str(tmp_path / "absent.tar"))
    with caplog.at_level(logging.INFO, logger="shared.cache"):
        key = use_compile_caches(settings, Args(str(tmp_path), max_model_len=512))
    root = tmp_path / layout.ROOT_NAME
    assert key is not None and key.root == str(root) and key.engine["max_model_len"] == 512
    assert {name: os.environ[name] for name in layout.cache_env(root)} == layout.cache_env(root)
    assert read_record(root) == key
    assert "absent.tar does not exist" in caplog.text  # and the start goes on


def test_the_hook_survives_its_own_failures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for name in layout.cache_env("/x"):
        monkeypatch.setenv(name, "before")
    settings = Settings(cache_dir=tmp_path, compile_cache=str(tmp_path / "p.tar"))

    def no_key(*args: Any) -> Any:
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr("shared.cache.start.start_key", no_key)
    with caplog.at_level(logging.INFO, logger="shared.cache"):
        assert use_compile_caches(settings, Args("m")) is None
    assert "key cannot be read: unexpected RuntimeError: NVML exploded" in caplog.text

    def unwritable(*args: Any) -> None:
        raise PermissionError("read-only file system")

    monkeypatch.undo()
    for name in layout.cache_env("/x"):
        monkeypatch.setenv(name, "before")
    monkeypatch.setattr("shared.cache.start.write_record", unwritable)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="shared.cache"):
        assert use_compile_caches(Settings(cache_dir=tmp_path, compile_cache_dir=tmp_path / "r"), Args("m"))
    assert "cannot be recorded" in caplog.text and "read-only file system" in caplog.text


def test_fetching_a_pack_never_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(*args: Any) -> Any:
        raise OSError("no space for the folder")

    monkeypatch.setattr("shared.cache.start.local_pack", broken)
    assert fetch_pack(Settings(cache_dir=tmp_path, compile_cache="https://example.invalid/p.tar")) is None


# --- the command line -------------------------------------------------------------------------------------
def test_cli_packs_the_recorded_start_and_shows_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    fill(root)
    write_record(root, key_for(root))
    assert cli(["pack", str(tmp_path / "p.tar.gz"), "--root", str(root)]) == 0
    assert f"{len(FILES)} files" in capsys.readouterr().out
    assert cli(["show", str(tmp_path / "p.tar.gz")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["files"] == len(FILES) and shown["valid_for"] == key_for(root).model_dump()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["pack", "OUT.tar", "--root", "EMPTY"], "no engine start is recorded in"),
        (["show", "NOT-A-PACK"], "is not a readable .tar/.tar.gz"),
        (["show", "NOWHERE"], "does not exist"),
        (["pack"], "the following arguments are required: OUT"),
        (["unpack", "x"], "invalid choice: 'unpack'"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(tmp_path: Path, argv: list[str], said: str) -> None:
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "NOT-A-PACK").write_bytes(b"plain text, not a tar")
    result = subprocess.run(
        [sys.executable, "-m", "shared.cache", *argv], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "BUNDLE_CACHE_DIR": str(tmp_path)}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and lines[0].startswith("python -m shared.cache"), result.stderr
    assert not (tmp_path / "OUT.tar").exists()


# --- the real server: a pack made from one start, used by the next -------------------------------------
def serve_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for name in (*layout.cache_env("/x"), "BUNDLE_COMPILE_CACHE", "BUNDLE_COMPILE_CACHE_DIR"):
        env.pop(name, None)
    return {**env, "BUNDLE_MAX_MODEL_LEN": "512", **extra}


def test_a_pack_from_one_server_start_is_used_by_the_next(tmp_path: Path) -> None:
    """The model-class cache vLLM writes on its first start (~14 s of inspection on this box
    when absent) comes back from the pack, and vLLM reads it without writing it again."""
    from bench.startup import start_once

    root = tmp_path / "root"
    first = start_once(
        serve_env(tmp_path, BUNDLE_COMPILE_CACHE_DIR=str(root)), "tiny", tmp_path / "first.log", 600
    )
    infos = sorted(p.relative_to(root) for p in (root / "modelinfos").iterdir())
    assert infos and read_record(root) is not None, (tmp_path / "first.log").read_text()[-3000:]
    subprocess.run(
        [sys.executable, "-m", "shared.cache", "pack", str(tmp_path / "p.tar"), "--root", str(root)],
        env=serve_env(tmp_path), check=True, timeout=120,
    )  # fmt: skip
    packed_times = {p: (root / p).stat().st_mtime for p in infos}
    shutil.rmtree(root)  # a new container: nothing but the pack

    env = serve_env(tmp_path, BUNDLE_COMPILE_CACHE_DIR=str(root), BUNDLE_COMPILE_CACHE=str(tmp_path / "p.tar"))
    second = start_once(env, "tiny", tmp_path / "second.log", 600)
    log = (tmp_path / "second.log").read_text()
    assert f"compile-cache pack {tmp_path / 'p.tar'}: used" in log, log[-3000:]
    assert {p: int((root / p).stat().st_mtime) for p in infos} == {p: int(t) for p, t in packed_times.items()}
    assert first["first_token_s"] > 0 and second["first_token_s"] > 0  # both served a token
