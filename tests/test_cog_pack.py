"""The compile-cache pack on Replicate's path: the real coglet, the real runner, COG_WEIGHTS a URL.

Two containers in turn, each with an emptied cache folder at the same path. The first gets the
weights' tar and a damaged pack by URL (BUNDLE_COMPILE_CACHE): one line says why the pack is not
used, and the runner is READY all the same; `python -m shared.cache pack` then packs what its
start left. The second gets a weights tar with that pack inside as a `cache/` folder, the way a
user ships it: the runner finds it, unpacks it (vLLM then reads its model-class cache from it
without writing it again), and greedy predictions are the same as the first container's.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx

from shared.cache.layout import ROOT_NAME
from shared.cache.manifest import MANIFEST_NAME
from shared.models import weights

from .test_cog import running_cog_server
from .test_cog_weights import Served, make_tar, served, tiny_model  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("The capital of France is", "Count with me: one, two,")


def greedy(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"input": {"prompt": prompt, "max_tokens": 12, "temperature": 0}}
        result = httpx.post(f"{url}/predictions", json=body, timeout=120).json()
        assert result["status"] == "succeeded", result
        texts.append("".join(result["output"]))
    return texts


def log_lines(log: Path, text: str) -> list[str]:
    """Messages of the runner's lines in coglet's JSON log that contain `text`."""
    found = []
    for line in log.read_text().splitlines():
        try:
            message = str(json.loads(line)["fields"]["message"])
        except (ValueError, KeyError, TypeError):
            message = line
        if text in message:
            found.append(message)
    return found


def with_pack_inside(model: Path, pack: Path) -> bytes:
    """The weights tar as a user ships it with a pack: the model folder and `cache/` beside it."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(make_tar(model))) as plain,
        tarfile.open(pack) as packed,
        tarfile.open(fileobj=out, mode="w") as tar,
    ):
        for info in plain.getmembers():
            tar.addfile(info, plain.extractfile(info) if info.isfile() else None)
        for info in packed.getmembers():
            reader = packed.extractfile(info)
            info.name = f"{weights.PACK_FOLDER}/{info.name}"
            # A long name's PAX "path" record would win over the new .name: drop it.
            info.pax_headers = {k: v for k, v in info.pax_headers.items() if k != "path"}
            tar.addfile(info, reader)
    return out.getvalue()


def test_a_container_packs_its_start_and_the_next_one_uses_it_from_the_weights(
    served: tuple[Served, str],  # noqa: F811
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811
) -> None:
    state, base = served
    cache = tmp_path / "cache"
    env = {"BUNDLE_CACHE_DIR": str(cache), "BUNDLE_MAX_MODEL_LEN": "512"}
    for name in ("BUNDLE_COMPILE_CACHE", "BUNDLE_COMPILE_CACHE_DIR"):
        assert name not in os.environ

    state.files["/plain.tar"] = make_tar(tiny_model)
    state.files["/damaged-pack.tar"] = os.urandom(100_000)
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    first_env = {**env, "COG_WEIGHTS": f"{base}/plain.tar", "BUNDLE_COMPILE_CACHE": f"{base}/damaged-pack.tar"}
    with running_cog_server(first_dir, **first_env) as server:
        first = greedy(server.url)
    refusals = log_lines(first_dir / "server.log", "not used")
    assert len(refusals) == 1 and "not a readable .tar/.tar.gz" in refusals[0], refusals
    assert log_lines(first_dir / "server.log", "vLLM imported in")  # beside the downloads

    root = cache / ROOT_NAME
    pack = tmp_path / "pack.tar"
    subprocess.run(
        [sys.executable, "-m", "shared.cache", "pack", str(pack), "--root", str(root)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, timeout=120,
    )  # fmt: skip
    with tarfile.open(pack) as tar:
        packed = {m.name: m.mtime for m in tar.getmembers() if m.name != MANIFEST_NAME}
    assert any("modelinfos/" in name for name in packed), sorted(packed)
    shutil.rmtree(cache)  # the next container starts with nothing but what it downloads

    state.files["/with-cache.tar"] = with_pack_inside(tiny_model, pack)
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    with running_cog_server(second_dir, **env, COG_WEIGHTS=f"{base}/with-cache.tar") as server:
        second = greedy(server.url)
    used = log_lines(second_dir / "server.log", "compile-cache pack")
    assert len(used) == 1 and ": used, " in used[0] and f"/{weights.PACK_FOLDER}" in used[0], used
    for name, mtime in packed.items():
        if "modelinfos/" in name:  # read by vLLM, not written again
            assert int((root / name.removeprefix("caches/")).stat().st_mtime) == mtime, name
    assert second == first
