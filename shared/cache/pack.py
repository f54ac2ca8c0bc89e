"""A pack on disk: written from a root, checked and unpacked into one.

A pack is a tar (plain, or gzip when its name ends in .gz/.tgz): `manifest.json` first, then
the root's files under `caches/`. An unpacked pack (a folder holding the same two, as a `cache/`
folder inside Cog's weights tar) is read the same way.

Unpacking is all or nothing. The manifest is read first and compared with this start's key:
no file is written for a pack made for another start. Then the caches go into a staging folder
inside the root, through tarfile's "data" filter (no absolute paths, no `..`, nothing leading
out) and a stricter rule of our own (regular files and folders only: no links, no devices).
Every file is checked against the manifest's size and SHA-256, and nothing may be missing or
extra; only then is the staging folder merged into the root, by renames. A file the root
already has is kept: the caches name their entries by what they compiled for, so equal names
hold equal contents. Any failure leaves the root as it was and raises `CompileCacheRefused`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import shutil
import stat
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pydantic import ValidationError

from shared.cache.layout import RECORD
from shared.cache.manifest import (
    CACHES_DIR,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    PackedFile,
    StartKey,
    describe_differences,
    differences,
)
from shared.errors import CompileCacheRefused

MIB = 1024 * 1024
CHUNK_BYTES = MIB
STAGING_PREFIX = ".pack-incoming-"  # inside the root, so that the final renames never cross disks
DISK_MARGIN_BYTES = 64 * MIB
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Written:
    path: Path
    files: int
    bytes: int
    skipped: tuple[str, ...]  # links and other non-files in the root, left out


@dataclass(frozen=True)
class Unpacked:
    files: int  # in the pack
    new_files: int  # of those, the ones the root did not hold yet
    bytes: int
    seconds: float


# --- writing -------------------------------------------------------------------------------------
def write_pack(root: Path, out: Path, key: StartKey, created: str) -> Written:
    """Pack every regular file under `root` (but its start record) into `out`, atomically."""
    paths, skipped = inventory(root)
    entries = tuple(PackedFile(path=p, size=(root / p).stat().st_size, sha256=digest(root / p)) for p in paths)
    manifest = Manifest(created=created, valid_for=key, files=entries)
    pending = out.with_name(out.name + ".part")
    gzip = out.name.endswith((".gz", ".tgz"))
    try:
        with tarfile.open(pending, "w:gz" if gzip else "w:", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, MANIFEST_NAME, manifest.dump())
            for entry in entries:
                _add_file(tar, root, entry)
        os.replace(pending, out)
    finally:
        pending.unlink(missing_ok=True)
    return Written(out, len(entries), manifest.total_bytes, skipped)


def inventory(root: Path) -> tuple[list[str], tuple[str, ...]]:
    """(regular files under `root`, relative and sorted; what was left out and why)."""
    files: list[str] = []
    skipped: list[str] = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(STAGING_PREFIX) and _keep_dir(here / d, skipped))
        for name in sorted(names):
            relative = (here / name).relative_to(root).as_posix()
            if relative == RECORD:
                continue
            mode = (here / name).lstat().st_mode
            if stat.S_ISREG(mode):
                files.append(relative)
            else:
                skipped.append(f"{relative} (not a regular file)")
    return files, tuple(skipped)


def _keep_dir(path: Path, skipped: list[str]) -> bool:
    if path.is_symlink():
        skipped.append(f"{path.name} (a link to a folder)")
        return False
    return True


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as source:
        for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
            sha.update(chunk)
    return sha.hexdigest()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _add_file(tar: tarfile.TarFile, root: Path, entry: PackedFile) -> None:
    path = root / entry.path
    status = path.stat()
    info = tarfile.TarInfo(f"{CACHES_DIR}/{entry.path}")
    info.size, info.mtime, info.mode = entry.size, int(status.st_mtime), status.st_mode & 0o755
    with path.open("rb") as source:
        reader = _Hashing(source)
        tar.addfile(info, reader)
    if reader.hexdigest() != entry.sha256:
        raise CompileCacheRefused(
            f"{entry.path} changed while it was packed: stop the engine that uses {root} first"
        )


class _Hashing:
    """A file object that hashes what tarfile reads from it."""

    def __init__(self, source: IO[bytes]) -> None:
        self._source = source
        self._sha = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._source.read(size)
        self._sha.update(data)
        return data

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


# --- reading ------------------------------------------------------------------------------------
def read_manifest(source: Path) -> Manifest:
    """The manifest of a pack (a tar or a folder), checked for form only."""
    if source.is_dir():
        return _parse_manifest(_read_limited(source / MANIFEST_NAME))
    with _open_tar(source) as tar:
        return _manifest_member(tar)


def unpack_into(source: Path, root: Path, here: StartKey) -> Unpacked:
    """Unpack the pack at `source` (a tar or a folder) into `root` if it was made for `here`."""
    started = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    try:
        manifest = _stage(source, staging, here, root)
        check_files(staging / CACHES_DIR, manifest)
        new = merge(staging / CACHES_DIR, root)
    except OSError as exc:  # disk full while staging or merging, a vanished file...
        raise CompileCacheRefused(_os_problem(exc)) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Unpacked(len(manifest.files), new, manifest.total_bytes, time.monotonic() - started)


def _stage(source: Path, staging: Path, here: StartKey, root: Path) -> Manifest:
    (staging / CACHES_DIR).mkdir()
    if source.is_dir():
        manifest = _parse_manifest(_read_limited(source / MANIFEST_NAME))
        _admit(manifest, here, root)
        if (source / CACHES_DIR).is_dir():
            shutil.copytree(source / CACHES_DIR, staging / CACHES_DIR, symlinks=True, dirs_exist_ok=True)
        return manifest
    with _open_tar(source) as tar:
        manifest = _manifest_member(tar)
        _admit(manifest, here, root)
        _extract_caches(tar, staging)
    return manifest


def _admit(manifest: Manifest, here: StartKey, root: Path) -> None:
    """Refuse a pack made for another start, or one the disk cannot hold, before writing."""
    found = differences(manifest.valid_for, here)
    if found:
        raise CompileCacheRefused(f"it was made for another start ({describe_differences(found)})")
    free = shutil.disk_usage(root).free
    if manifest.total_bytes + DISK_MARGIN_BYTES > free:
        raise CompileCacheRefused(
            f"it needs {manifest.total_bytes / MIB:.1f} MiB (+{DISK_MARGIN_BYTES // MIB} MiB margin), "
            f"{free / MIB:.1f} MiB free in {root}"
        )


class _open_tar:  # noqa: N801  (a context manager used like `open`)
    """tarfile.open, with every way a damaged archive fails said as one refusal."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.tar: tarfile.TarFile | None = None

    def __enter__(self) -> tarfile.TarFile:
        try:
            self.tar = tarfile.open(self.source, "r:*")
        except FileNotFoundError as exc:
            raise CompileCacheRefused(f"{self.source} does not exist") from exc
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
            raise CompileCacheRefused(f"{self.source} is not a readable .tar/.tar.gz: {_said(exc)}") from exc
        return self.tar

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if self.tar is not None:
            self.tar.close()
        if isinstance(error, tarfile.FilterError):
            raise CompileCacheRefused(f"an unsafe member, refused: {_said(error)}") from error
        if isinstance(error, (tarfile.TarError, EOFError, zlib.error)):
            raise CompileCacheRefused(f"the archive is damaged or cut short: {_said(error)}") from error


def _manifest_member(tar: tarfile.TarFile) -> Manifest:
    first = tar.next()
    if first is None or first.name != MANIFEST_NAME or not first.isfile():
        raise CompileCacheRefused(f"its first member is not {MANIFEST_NAME}: not a compile-cache pack")
    if first.size > MAX_MANIFEST_BYTES:
        raise CompileCacheRefused(f"its {MANIFEST_NAME} is {first.size} bytes, too large")
    reader = tar.extractfile(first)
    if reader is None:
        raise CompileCacheRefused(f"its {MANIFEST_NAME} cannot be read")
    return _parse_manifest(reader.read())


def _extract_caches(tar: tarfile.TarFile, staging: Path) -> None:
    prefix = CACHES_DIR + "/"
    for member in _rest(tar):
        if not (member.name.startswith(prefix) or member.name == CACHES_DIR):
            raise CompileCacheRefused(f"member {member.name!r} lies outside {prefix}: refused")
        if not (member.isfile() or member.isdir()):
            raise CompileCacheRefused(f"member {member.name!r} is a link or a device, refused")
        tar.extract(member, staging, filter="data")


def _rest(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    while (member := tar.next()) is not None:
        yield member


def _read_limited(path: Path) -> bytes:
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CompileCacheRefused(f"{path} is too large for a manifest")
        return path.read_bytes()
    except OSError as exc:
        raise CompileCacheRefused(
            f"no readable {MANIFEST_NAME} in {path.parent}: not a compile-cache pack"
        ) from exc


def _parse_manifest(data: bytes) -> Manifest:
    try:
        return Manifest.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the document"
        raise CompileCacheRefused(f"its {MANIFEST_NAME} is malformed ({where}: {first['msg']})") from exc


# --- checking and merging -----------------------------------------------------------------------------
def check_files(caches: Path, manifest: Manifest) -> None:
    """Everything under `caches` is a regular file the manifest lists, with its size and hash,
    and every file it lists is there."""
    expected = {entry.path: entry for entry in manifest.files}
    seen: set[str] = set()
    for path in _walk(caches):
        relative = path.relative_to(caches).as_posix()
        entry = expected.get(relative)
        if entry is None:
            raise CompileCacheRefused(f"{relative} is not in its manifest: refused")
        if path.stat().st_size != entry.size:
            raise CompileCacheRefused(
                f"{relative} has {path.stat().st_size} bytes, its manifest says {entry.size}: "
                "cut short or damaged"
            )
        if digest(path) != entry.sha256:
            raise CompileCacheRefused(f"{relative} does not match its SHA-256: damaged")
        seen.add(relative)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CompileCacheRefused(
            f"{len(missing)} file(s) of its manifest are missing (first: {missing[0]}): incomplete"
        )


def _walk(caches: Path) -> Iterator[Path]:
    for folder, dirs, names in os.walk(caches):
        for name in dirs + names:
            path = Path(folder) / name
            mode = path.lstat().st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise CompileCacheRefused(f"{path.relative_to(caches)} is a link or a device, refused")
            if stat.S_ISREG(mode):
                yield path


def merge(source: Path, target: Path) -> int:
    """Move what `source` holds into `target`, keeping what `target` already has; the number
    of files moved. Whole folders move in one rename where `target` has none of that name."""
    target.mkdir(parents=True, exist_ok=True)
    moved = 0
    for entry in sorted(source.iterdir()):
        there = target / entry.name
        if not os.path.lexists(there):
            count = _count_files(entry)
            os.replace(entry, there)
            moved += count
        elif entry.is_dir() and there.is_dir() and not there.is_symlink():
            moved += merge(entry, there)
    return moved


def _count_files(path: Path) -> int:
    if not path.is_dir():
        return 1
    return sum(len(names) for _, _, names in os.walk(path))


def _said(exc: BaseException) -> str:
    """An exception's first line (tarfile lists every method it tried, one per line)."""
    lines = str(exc).strip().splitlines()
    return lines[0].rstrip(":") if lines else type(exc).__name__


def _os_problem(exc: OSError) -> str:
    if exc.errno in _DISK_FULL:
        return f"the disk filled up while unpacking it: {exc}"
    return f"unpacking it failed: {type(exc).__name__}: {exc}"
