"""Where a LoRA adapter's files come from: a local directory, a Hugging Face id, or a tar at a URL.

Each source ends as a local directory holding `adapter_config.json` and the weights, which is
what vLLM loads. Fetching is blocking (disk, network): callers run it in a thread. Every failure
is an `InvalidRequest` naming the source, so a bad adapter is the client's 400, never a 500.

TODO: shared/models/weights.py fetches COG_WEIGHTS tars (parallel ranged parts, disk checks, a
completion marker); the single-stream download and unpack below repeat part of it. Sharing needs
weights.py to take the folder test (adapter_config.json, not config.json), a size cap and the
error to raise (a 400 here, a setup failure there).
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

from shared.errors import InvalidRequest

log = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHT_PATTERNS = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "*.json")
# An owner/name Hugging Face id (optionally @revision); anything else that is not a directory
# cannot be fetched, and saying so beats a hub error about a malformed id.
HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")
MAX_DOWNLOAD_BYTES = 4 << 30  # an adapter is megabytes; gigabytes mean a wrong URL (a base model)
DOWNLOAD_TIMEOUT_S = 120.0


def fetch_adapter(source: str, cache_dir: Path) -> Path:
    """The local directory of the adapter `source` names (downloaded once into `cache_dir`)."""
    source = source.strip()
    if source.startswith(("http://", "https://")):
        return _from_url(source, cache_dir)
    path = Path(source).expanduser()
    if path.is_dir():
        return _adapter_dir(path, source)
    if source.startswith(("/", ".", "~")) or not HF_ID.match(source):
        raise InvalidRequest(f"adapter {source!r}: no such directory", param="lora_path", code="lora_not_found")
    return _from_hub(source)


def _adapter_dir(root: Path, source: str) -> Path:
    """`root`, or the one directory below it holding adapter_config.json (tars often wrap one)."""
    if (root / CONFIG_NAME).is_file():
        return root
    found = sorted(config.parent for config in root.rglob(CONFIG_NAME))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise InvalidRequest(
            f"adapter {source!r}: {what} {CONFIG_NAME} found (a PEFT LoRA adapter has exactly one)",
            param="lora_path",
            code="invalid_lora_adapter",
        )
    return found[0]


def _from_hub(source: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo_id, _, revision = source.partition("@")
    try:
        local = snapshot_download(repo_id, revision=revision or None, allow_patterns=list(WEIGHT_PATTERNS))
    except (RepositoryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise InvalidRequest(
            f"adapter {source!r}: cannot download it from Hugging Face: {type(exc).__name__}: {exc}"[:500],
            param="lora_path",
            code="lora_download_failed",
        ) from exc
    return _adapter_dir(Path(local), source)


def _from_url(url: str, cache_dir: Path) -> Path:
    """Download and unpack a tar once per cache directory (a Modal Volume, a Cog container)."""
    target = cache_dir / hashlib.sha256(url.encode()).hexdigest()[:24]
    if (target / ".complete").is_file():
        return _adapter_dir(target, url)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as work:
        archive = Path(work) / "adapter.tar"
        _download(url, archive)
        unpacked = Path(work) / "unpacked"
        _unpack(archive, unpacked, url)
        _adapter_dir(unpacked, url)  # refuse before caching what is no adapter
        (unpacked / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        unpacked.rename(target)  # atomic within one filesystem: readers never see half a tar
    log.info("adapter %s cached in %s", url, target)
    return _adapter_dir(target, url)


def _download(url: str, archive: Path) -> None:
    import httpx

    def failed(why: str) -> InvalidRequest:
        return InvalidRequest(
            f"adapter {url!r}: download failed: {why}"[:500], param="lora_path", code="lora_download_failed"
        )

    try:
        with httpx.stream("GET", url, follow_redirects=True, timeout=DOWNLOAD_TIMEOUT_S) as response:
            if response.status_code != 200:
                raise failed(f"HTTP {response.status_code}")
            size = 0
            with archive.open("wb") as out:
                for chunk in response.iter_bytes(1 << 20):
                    size += len(chunk)
                    if size > MAX_DOWNLOAD_BYTES:
                        raise failed(f"larger than {MAX_DOWNLOAD_BYTES >> 30} GiB")
                    out.write(chunk)
    except httpx.HTTPError as exc:
        raise failed(f"{type(exc).__name__}: {exc}") from exc


def _unpack(archive: Path, into: Path, url: str) -> None:
    try:
        with tarfile.open(archive) as tar:
            # The "data" filter refuses absolute paths, `..`, links out of the tree and devices:
            # the tar comes from a URL a client chose.
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise InvalidRequest(
            f"adapter {url!r}: not a readable tar archive: {exc}"[:500],
            param="lora_path",
            code="lora_download_failed",
        ) from exc
