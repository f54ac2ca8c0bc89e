"""Where a pack comes from: a local file or folder as it is, a URL downloaded first.

A pack is small next to the weights (tens of MB against GBs), so one stream is enough; the Cog
runner downloads it beside the weights (shared/assembly.py, `prepare_start`). The download goes
to a temporary name in `<cache_dir>/compile-packs/` and gets its final name only once every
byte the server announced has arrived, so a cut-off download is never read as a pack.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from shared.errors import CompileCacheRefused

log = logging.getLogger(__name__)

PACKS_DIR = "compile-packs"
CHUNK_BYTES = 1024 * 1024
TIMEOUT = httpx.Timeout(60.0, connect=30.0)


def is_url(source: str) -> bool:
    return urlsplit(source).scheme in ("http", "https")


def local_pack(source: str, cache_dir: Path) -> Path:
    """The pack named by `source` on this disk; raises `CompileCacheRefused` when there is none."""
    if is_url(source):
        return download_pack(source, cache_dir)
    path = Path(source).expanduser()
    if not path.exists():
        raise CompileCacheRefused(f"{path} does not exist")
    return path


def download_pack(url: str, cache_dir: Path) -> Path:
    folder = cache_dir / PACKS_DIR
    name = hashlib.sha256(url.encode()).hexdigest()[:24]
    final, pending = folder / f"{name}.tar", folder / f"{name}.tar.part"
    started = time.monotonic()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        size = _stream(url, pending)
        os.replace(pending, final)
    except httpx.HTTPError as exc:
        raise CompileCacheRefused(f"downloading it failed: {type(exc).__name__}: {exc}") from exc
    except OSError as exc:
        raise CompileCacheRefused(f"downloading it failed: {exc}") from exc
    finally:
        pending.unlink(missing_ok=True)
    seconds = time.monotonic() - started
    log.info(
        "compile-cache pack: downloaded %.1f MiB from %s into %s in %.1f s",
        size / CHUNK_BYTES,
        url,
        final,
        seconds,
    )
    return final


def _stream(url: str, dest: Path) -> int:
    """Write the body of `url` to `dest`; the byte count, checked against Content-Length."""
    written = 0
    with (
        httpx.Client(timeout=TIMEOUT, follow_redirects=True) as client,
        client.stream("GET", url) as response,
    ):
        if response.status_code >= 400:
            raise CompileCacheRefused(f"HTTP {response.status_code} {response.reason_phrase}")
        announced = response.headers.get("content-length", "")
        with dest.open("wb") as out:
            for chunk in response.iter_raw(CHUNK_BYTES):
                out.write(chunk)
                written += len(chunk)
    if announced.isdigit() and written != int(announced):
        raise CompileCacheRefused(f"got {written} of {announced} bytes: cut short")
    return written
