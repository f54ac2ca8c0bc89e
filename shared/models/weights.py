"""Weights named by a URL, the way Replicate ships them: a `.tar` or `.tar.gz` to fetch at setup.

`resolve_weights(source, cache_dir)` turns what the platform hands over (Cog's `COG_WEIGHTS`)
into what vLLM can load: a URL is downloaded into `cache_dir/weights/<key of the URL>/`, several
ranged requests at once when the server takes `Range` (one stream when it does not), unpacked
with tarfile's "data" filter (no absolute paths, no `..`, no links leading out), and the model
folder inside is returned. Anything else (a local folder, a Hugging Face id) is passed through.

vLLM is given the model through a stable link, `cache_dir/weights/served-<hash of its
config.json>`, whatever the URL: vLLM's compile cache is keyed by the path it loads from, so a
compile-cache pack made with one weights URL serves another URL of the same weights (say the same
tar with a `cache/` folder added: the pack travelling inside the weights, `bundled_pack`), or of
another fine-tune of the same base. One setup at a time per cache folder, then (a container has
its own): two fine-tunes of one base set up at once in one folder would share the link.

A cache entry counts as complete only once its `complete.json` exists, and that file is written
last: after every byte arrived (the count checked against the server's length) and the archive
unpacked without an error. A download or unpack cut short leaves no marker, so the next setup
clears the entry and starts again instead of serving half a model.

Every failure is a `WeightsUnavailable` naming the URL and what went wrong (HTTP status, bad
archive, unsafe member, no model inside, disk full), so a failed setup on Replicate says why.
No cog import here: the Modal app can use it as well.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tarfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from shared.errors import WeightsUnavailable

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# Several connections at once: one TCP stream from a CDN tops out far below a GPU host's link
# (cog-vllm fetches its weights the same way, with pget). 8 keeps per-part overhead small.
PARALLEL_PARTS = 8
# Below this a part is not worth its own request (the tiny test archive is a few MB: tests lower it).
MIN_PART_BYTES = 16 * MIB
CHUNK_BYTES = MIB
ATTEMPTS = 3  # per part, each resuming where the previous one stopped
PROGRESS_EVERY_S = 5.0
# Kept free beyond the archive itself: the cache marker, logs and vLLM's own files need room too.
DISK_MARGIN_BYTES = 64 * MIB
TIMEOUT = httpx.Timeout(60.0, connect=30.0)
COMPLETE_MARKER = "complete.json"
SERVED_LINK = "served"  # cache_dir/weights/served-<config hash> -> the model folder being served
PACK_FOLDER = "cache"  # a compile-cache pack inside the weights tar, beside the model
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def resolve_weights(
    source: str,
    cache_dir: Path,
    *,
    parts: int = PARALLEL_PARTS,
    min_part_bytes: int = MIN_PART_BYTES,
) -> str:
    """What vLLM should load for `source`: the unpacked model folder of a URL, else `source`."""
    if not is_url(source):
        return source  # a local folder or a Hugging Face id: vLLM reads those itself
    model = fetch_weights(source, cache_dir, parts=parts, min_part_bytes=min_part_bytes)
    return str(serve_through_link(model, cache_dir))


def serve_through_link(model: Path, cache_dir: Path) -> Path:
    """The stable path vLLM is given for `model`: a link named by its config.json's hash,
    swapped atomically to point at it. Weights of one architecture and shape (fine-tunes of one
    base) share the link, and so a pack; other models in the same cache folder get their own."""
    digest = hashlib.sha256((model / "config.json").read_bytes()).hexdigest()[:16]
    link = cache_dir / "weights" / f"{SERVED_LINK}-{digest}"
    pending = link.with_name(f"{link.name}.{os.getpid()}.tmp")
    pending.unlink(missing_ok=True)
    pending.symlink_to(model.resolve(), target_is_directory=True)
    os.replace(pending, link)
    return link


def bundled_pack(source: str, cache_dir: Path) -> Path | None:
    """The `cache/` folder that came with the weights at `source` (a URL), if it had one."""
    if not is_url(source):
        return None
    folder = cache_entry(source, cache_dir) / "files" / PACK_FOLDER
    return folder if folder.is_dir() else None


def is_url(source: str) -> bool:
    return urlsplit(source).scheme in ("http", "https")


def cache_entry(url: str, cache_dir: Path) -> Path:
    """The folder one URL's weights live in (the key is the whole URL, query included)."""
    return cache_dir / "weights" / hashlib.sha256(url.encode()).hexdigest()[:24]


def fetch_weights(
    url: str, cache_dir: Path, *, parts: int = PARALLEL_PARTS, min_part_bytes: int = MIN_PART_BYTES
) -> Path:
    """Download and unpack `url` once; later calls reuse the completed entry without a request."""
    entry = cache_entry(url, cache_dir)
    reused = _completed(entry)
    if reused is not None:
        log.info("weights: reusing %s, unpacked from %s", reused, url)
        return reused
    shutil.rmtree(entry, ignore_errors=True)  # whatever an interrupted attempt left behind
    entry.mkdir(parents=True)
    archive = entry / "archive.part"
    started = time.monotonic()
    with httpx.Client(timeout=TIMEOUT, follow_redirects=True) as client:
        remote = _probe(client, url)
        download(client, remote, archive, parts=parts, min_part_bytes=min_part_bytes)
    log.info("weights: downloaded %.1f MiB in %.1f s", archive.stat().st_size / MIB, time.monotonic() - started)
    try:
        unpacked = unpack(archive, entry / "files", url)
    finally:
        archive.unlink(missing_ok=True)  # the unpacked copy is what is kept: not twice the disk
    model = model_folder(unpacked, url)
    _write_marker(entry, url, model.relative_to(entry))
    log.info("weights: %s ready in %.1f s", model, time.monotonic() - started)
    return model


def _completed(entry: Path) -> Path | None:
    try:
        marker = json.loads((entry / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    model = entry / marker["model"]
    return model if (model / "config.json").is_file() else None


def _write_marker(entry: Path, url: str, model: Path) -> None:
    pending = entry / f"{COMPLETE_MARKER}.tmp"
    pending.write_text(json.dumps({"url": url, "model": str(model)}))
    os.replace(pending, entry / COMPLETE_MARKER)  # atomic: the marker exists whole or not at all


# --- download ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Remote:
    url: str
    size: int | None  # None: the server did not say
    ranges: bool  # it answered a Range request with 206


def _probe(client: httpx.Client, url: str) -> Remote:
    """Ask for the first byte: a 206 tells the size and that ranges work; a 200 that they don't
    (its body is not read: the connection is closed instead)."""
    try:
        with client.stream("GET", url, headers={"Range": "bytes=0-0"}) as response:
            _check_status(response, url)
            if response.status_code == 206:
                total = _content_range_total(response.headers.get("content-range", ""))
                return Remote(url, total, ranges=total is not None)
            length = response.headers.get("content-length", "")
            return Remote(url, int(length) if length.isdigit() else None, ranges=False)
    except httpx.HTTPError as exc:
        raise WeightsUnavailable(f"cannot fetch the weights at {url}: {type(exc).__name__}: {exc}") from exc


def _check_status(response: httpx.Response, url: str) -> None:
    if response.status_code >= 400:
        raise WeightsUnavailable(
            f"cannot fetch the weights at {url}: HTTP {response.status_code} {response.reason_phrase}"
        )


def _content_range_total(header: str) -> int | None:
    """'bytes 0-0/1234' -> 1234; None when the total is '*' or the header is malformed."""
    total = header.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def download(client: httpx.Client, remote: Remote, dest: Path, *, parts: int, min_part_bytes: int) -> None:
    """Write the whole resource to `dest`, checking its length; ranged and parallel if possible."""
    if remote.size is not None:
        check_space(dest.parent, remote.size, remote.url, "the download")
    progress = Progress(remote.url, remote.size)
    spans = split(remote.size, parts, min_part_bytes) if remote.ranges and remote.size else []
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if len(spans) > 1:
            _fetch_spans(client, remote.url, fd, spans, progress)
        else:
            log.info(
                "weights: one stream from %s (%s)",
                remote.url,
                "no Range support" if not remote.ranges else "small",
            )
            _fetch_whole(client, remote, fd, progress)
    finally:
        os.close(fd)
    progress.finish()


def split(size: int, parts: int, min_part_bytes: int) -> list[tuple[int, int]]:
    """Inclusive byte spans covering [0, size), at most `parts`, each at least `min_part_bytes`
    (but the last)."""
    count = max(1, min(parts, size // max(1, min_part_bytes)))
    step = -(-size // count)
    return [(start, min(start + step, size) - 1) for start in range(0, size, step)]


def _fetch_spans(
    client: httpx.Client, url: str, fd: int, spans: list[tuple[int, int]], progress: Progress
) -> None:
    log.info("weights: %d ranged requests in parallel from %s", len(spans), url)
    stop = threading.Event()  # one part failing stops the others: the setup fails anyway

    def fetch(span: tuple[int, int]) -> None:
        try:
            _fetch_span(client, url, fd, span, progress, stop)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(len(spans), thread_name_prefix="weights") as pool:
        for future in [pool.submit(fetch, span) for span in spans]:
            future.result()  # the first failure propagates (the pool waits for the rest)


def _fetch_span(
    client: httpx.Client, url: str, fd: int, span: tuple[int, int], progress: Progress, stop: threading.Event
) -> None:
    start, end = span
    offset, problem = start, "no attempt"
    for _ in range(ATTEMPTS):
        try:
            with client.stream("GET", url, headers={"Range": f"bytes={offset}-{end}"}) as response:
                _check_status(response, url)
                if response.status_code != 206:
                    raise WeightsUnavailable(
                        f"{url} ignored a Range request it had honoured (HTTP {response.status_code})"
                    )
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    if stop.is_set():
                        return
                    if offset + len(chunk) > end + 1:
                        raise WeightsUnavailable(f"{url} sent more bytes than asked for in bytes={start}-{end}")
                    write_at(fd, chunk, offset, url)
                    offset += len(chunk)
                    progress.add(len(chunk))
            if offset == end + 1:
                return
            problem = f"the answer ended at byte {offset}"
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}"
    raise WeightsUnavailable(
        f"download of the weights at {url} failed in bytes {start}-{end} after {ATTEMPTS} attempts: {problem}"
    )


def _fetch_whole(client: httpx.Client, remote: Remote, fd: int, progress: Progress) -> None:
    problem = "no attempt"
    for _ in range(ATTEMPTS):  # without ranges a retry starts again from the first byte
        written = 0
        try:
            with client.stream("GET", remote.url) as response:
                _check_status(response, remote.url)
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    write_at(fd, chunk, written, remote.url)
                    written += len(chunk)
                    progress.add(len(chunk))
            if remote.size is None or written == remote.size:
                os.ftruncate(fd, written)
                return
            problem = f"got {written} of {remote.size} bytes"
        except httpx.TransportError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        progress.add(-written)
    raise WeightsUnavailable(
        f"download of the weights at {remote.url} failed after {ATTEMPTS} attempts: {problem}"
    )


def write_at(fd: int, data: bytes, offset: int, url: str) -> None:
    view = memoryview(data)
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise WeightsUnavailable(
                f"the disk filled up while downloading the weights at {url}: {exc}"
            ) from exc
        raise


class Progress:
    """Bytes received so far, logged every PROGRESS_EVERY_S (threads add to it at once)."""

    def __init__(self, url: str, total: int | None) -> None:
        self.url, self.total = url, total
        self.done = 0
        self._lock = threading.Lock()
        self._started = self._logged = time.monotonic()

    def add(self, count: int) -> None:
        with self._lock:
            self.done += count
            now = time.monotonic()
            if now - self._logged < PROGRESS_EVERY_S:
                return
            self._logged = now
        self._log(now)

    def finish(self) -> None:
        self._log(time.monotonic())

    def _log(self, now: float) -> None:
        rate = self.done / MIB / max(now - self._started, 1e-6)
        share = f" of {self.total / MIB:.1f} MiB ({100 * self.done / self.total:.0f} %)" if self.total else ""
        log.info("weights: %.1f MiB%s, %.1f MiB/s", self.done / MIB, share, rate)


# --- disk and archive ------------------------------------------------------------------------------
def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_space(directory: Path, needed: int, url: str, what: str) -> None:
    """Refuse before writing rather than fill the disk part-way."""
    free = free_bytes(directory)
    if needed + DISK_MARGIN_BYTES > free:
        raise WeightsUnavailable(
            f"not enough disk for the weights at {url}: {what} needs {needed / MIB:.1f} MiB "
            f"(+{DISK_MARGIN_BYTES // MIB} MiB margin), {free / MIB:.1f} MiB free in {directory}"
        )


def unpack(archive: Path, dest: Path, url: str) -> Path:
    """Extract a tar (plain or compressed) into `dest`, refusing unsafe members."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            check_space(dest.parent, sum(m.size for m in members if m.isfile()), url, "unpacking")
            # The "data" filter refuses absolute paths, '..', links leading outside `dest`, and
            # device files, and drops permissions an archive should not set.
            tar.extractall(dest, filter="data")
    except tarfile.FilterError as exc:
        raise WeightsUnavailable(f"the archive at {url} has an unsafe member, refused: {exc}") from exc
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise WeightsUnavailable(f"the disk filled up while unpacking the weights at {url}: {exc}") from exc
        raise WeightsUnavailable(f"the weights at {url} are not a readable tar archive: {exc}") from exc
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise WeightsUnavailable(
            f"the weights at {url} are not a valid .tar/.tar.gz archive (or it is truncated): {exc}"
        ) from exc
    return dest


def model_folder(root: Path, url: str) -> Path:
    """The folder holding config.json: the archive's root, or its single top folder (a
    compile-cache pack's `cache/` folder beside it does not count)."""
    if (root / "config.json").is_file():
        return root
    # Dot-entries are ignored: archives made on macOS carry `._name` resource forks.
    entries = sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.name != PACK_FOLDER)
    if len(entries) == 1 and (entries[0] / "config.json").is_file():
        return entries[0]
    names = ", ".join(p.name for p in entries[:10]) or "nothing"
    raise WeightsUnavailable(
        f"the archive at {url} holds no model: no config.json at its root or in a single top folder "
        f"(found: {names})"
    )
