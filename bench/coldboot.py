"""Cold boots from an empty container, with and without a compile-cache pack (issue 38).

    python -m bench.coldboot --part cog  --work /tmp/coldboot --out DIR   # ~3-4 min on the H200
    python -m bench.coldboot --part rest --work /tmp/coldboot --out DIR   # ~5 min; needs `cog` first
    python -m bench.coldboot --part again --work /tmp/coldboot --out DIR  # ~3 min; needs `cog` first

Part `cog`: coglet serving cog/predict.py:Runner, COG_WEIGHTS the URL of a tar of the model
folder (a local HTTP server), as Replicate starts a trained version:
  cog-empty     an empty container: fresh HOME and cache folder (the caches' root inside it);
                its root is then packed (`python -m shared.cache pack`);
  cog-pack      the same, COG_WEIGHTS now a tar with that pack inside as `cache/`.
Part `rest`:
  cog-mismatch  COG_WEIGHTS the plain tar, BUNDLE_COMPILE_CACHE the URL of the same pack with its
                manifest saying another vLLM version: it must be refused in one line;
  serve-empty   `python -m shared.serve` with an empty root (BUNDLE_COMPILE_CACHE_DIR), packed;
  serve-pack    the same with BUNDLE_COMPILE_CACHE naming that pack.
Part `again` (each time it runs: -2, -3, ...):
  cog-empty-N, cog-pack-N   the two Cog boots of part `cog` once more, on the same tars and pack:
                one boot per kind judges the host as much as the code (the same empty boot took
                106-118 s across leases), so the bars are judged on the median of the boots there are.
Every boot answers the same 16 prompts greedily (one at a time, so that no batch differs); a
pack boot's texts must equal its empty boot's. Phases come from coglet's log (bench/coldboot_logs.py)
and from the server's log (bench/startup.py's milestones). Results merge into DIR/coldboot.json
(schema bundle-coldboot/1, read by the cost model); the logs and packs stay in --work.

Engine settings come from BUNDLE_* as everywhere: on a CPU box the tiny model and eager mode
(a dry run: minutes), on the H200 what bench/gpu.sh sets (`bash bench/gpu.sh coldboot-cog`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from datetime import UTC, datetime
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench.cog_rehearsal import coglet, wait_setup
from bench.coldboot_logs import COG_MILESTONES, cog_phases, setup_errors
from bench.servers import free_port, wait_healthy
from bench.startup import PHASES, LogCapture, machine, milestones, phases, spawned_server, vllm_version
from cost_model.coldboot import is_boot_of
from shared.cache.layout import ROOT_NAME, cache_env
from shared.cache.manifest import MANIFEST_NAME
from shared.engine.vllm_startup import resolve_model_path
from shared.models.weights import PACK_FOLDER
from shared.settings import Settings

SCHEMA = "bundle-coldboot/1"
PARTS = ("cog", "rest", "again")
PROMPTS = tuple(
    f"Question {n}: in two sentences, what is {topic}?"
    for n, topic in enumerate(
        ("a compiler", "a kernel", "a cache", "a graph", "a tensor", "a token", "a GPU", "a tar file",
         "a manifest", "a checksum", "a container", "a snapshot", "a volume", "a scheduler",
         "a sampler", "a warm-up"),
        start=1,
    )
)  # fmt: skip
MISMATCH_SUFFIX = "+another-build"  # appended to the pack's vLLM version: a pack for another image
# The bars on the H200 (one lease): READY with a pack, without, /health with a pack; each
# judged on the median of that kind's boots (part `again` adds boots of the two Cog kinds).
BARS_S = {"cog-pack": 45.0, "cog-empty": 110.0, "serve-pack": 45.0}
NOT_SLOWER_SLACK = 1.05  # "no slower than empty": within 5 % of the empty boots' median


# --- files the boots fetch -----------------------------------------------------------------------------
class Files:
    """A folder served over HTTP (COG_WEIGHTS and pack URLs)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        handler = partial(_QuietHandler, directory=str(folder))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def copyfile(self, source: Any, outputfile: Any) -> None:
        # The weights fetcher's first request reads the headers only (its size probe).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().copyfile(source, outputfile)


def weights_tar(model: Path, pack: Path | None = None) -> bytes:
    """The model folder as a Cog weights tar; with `pack`, its contents beside it as `cache/`."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for path in sorted(model.iterdir()):
            tar.add(path, arcname=f"model/{path.name}")
        if pack is not None:
            with tarfile.open(pack) as packed:
                for info in packed.getmembers():
                    reader = packed.extractfile(info)
                    info.name = f"{PACK_FOLDER}/{info.name}"
                    # A long name's PAX "path" record would win over the new .name: drop it.
                    info.pax_headers = {k: v for k, v in info.pax_headers.items() if k != "path"}
                    tar.addfile(info, reader)
    return out.getvalue()


def mismatched(pack: Path, out: Path) -> Path:
    """A copy of `pack` whose manifest says it was made with another vLLM build."""
    with tarfile.open(pack) as source, tarfile.open(out, "w") as target:
        for info in source.getmembers():
            reader = source.extractfile(info)
            data = reader.read() if reader else b""
            if info.name == MANIFEST_NAME:
                manifest = json.loads(data)
                manifest["valid_for"]["packages"]["vllm"] = (
                    f"{manifest['valid_for']['packages']['vllm']}{MISMATCH_SUFFIX}"
                )
                data = json.dumps(manifest, indent=2).encode()
                info.size = len(data)
            target.addfile(info, io.BytesIO(data))
    return out


def make_pack(root: Path, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "shared.cache", "pack", str(out), "--root", str(root)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"packing {root} failed: {done.stderr.strip()}")
    with tarfile.open(out) as tar:
        manifest = json.loads(tar.extractfile(tar.next()).read())  # type: ignore[arg-type, union-attr]
    return {
        "said": done.stdout.strip().splitlines()[0],
        "files": len(manifest["files"]),
        "mib": round(sum(f["size"] for f in manifest["files"]) / 2**20, 1),
        "tar_mib": round(out.stat().st_size / 2**20, 1),
    }


# --- one boot -------------------------------------------------------------------------------------------
def fresh_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment with nothing of an earlier start in it: a new, empty HOME (Triton,
    FlashInfer, CUDA and Hugging Face caches default under it) and no cache variables."""
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in cache_env("/") and not k.startswith("BUNDLE_COMPILE_CACHE")
    }
    return {**env, "HOME": str(home), "PYTHONUNBUFFERED": "1", **extra}


def boot_cog(name: str, env: dict[str, str], work: Path, timeout_s: float) -> dict[str, Any]:
    port, log = free_port(), work / f"{name}.log"
    spawned = time.time()
    with coglet(port, 32, log, work, env=env) as process:
        status, ready_s, answer = wait_setup(f"http://127.0.0.1:{port}", process, timeout_s)
        _say(f"{name}: {status} after {ready_s:.1f} s")
        result: dict[str, Any] = {"target": "cog", "status": status, "ready_s": round(ready_s, 2)}
        if status == "READY":
            result["greedy"] = greedy_cog(f"http://127.0.0.1:{port}")
        else:
            result["health_check"] = answer
            result["setup_errors"] = setup_errors(log)
    return {**result, **cog_phases(log, spawned), "log": log.name}


def boot_serve(name: str, env: dict[str, str], work: Path, timeout_s: float) -> dict[str, Any]:
    port, log = free_port(), LogCapture(work / f"{name}.log")
    with spawned_server(env, port, log) as (process, spawned):
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process, timeout_s, interval_s=0.05)
        healthy = time.time() - spawned
        _say(f"{name}: /health after {healthy:.1f} s")
        texts = greedy_openai(base, Settings().model_name)
    seen = milestones(log.lines, spawned)
    seen["health"] = healthy
    pack_lines = [line for _, line in log.lines if "compile-cache pack" in line]
    return {
        "target": "serve",
        "status": "healthy",
        "ready_s": round(healthy, 2),
        "milestones": {k: round(v, 3) for k, v in seen.items()},
        "phases": phases(seen),
        "pack_lines": [line[:400] for line in pack_lines],
        "greedy": texts,
        "log": log.path.name,
    }


def greedy_cog(url: str) -> list[str]:
    texts = []
    with httpx.Client(timeout=300) as client:
        for prompt in PROMPTS:
            body = {"input": {"prompt": prompt, "max_tokens": 32, "temperature": 0}}
            result = client.post(f"{url}/predictions", json=body).json()
            texts.append(
                "".join(result.get("output") or []) if result.get("status") == "succeeded" else f"<{result}>"
            )
    return texts


def greedy_openai(url: str, model: str) -> list[str]:
    texts = []
    with httpx.Client(timeout=300) as client:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0}
            answer = client.post(f"{url}/v1/completions", json=body)
            texts.append(
                answer.json()["choices"][0]["text"] if answer.status_code == 200 else f"<{answer.text}>"
            )
    return texts


# --- the parts: cog, rest, again ---------------------------------------------------------------------------
def cog_cache(work: Path) -> Path:
    """The Cog boots' cache folder: the same path in every boot, as vLLM keys its cache by the
    model's path (which lies under it)."""
    return work / "cog-home" / ".cache" / "bundle"


def boot_cog_from(
    name: str, files: Files, tar: str, work: Path, timeout_s: float, **extra: str
) -> dict[str, Any]:
    """One Cog boot in an empty container, COG_WEIGHTS the URL of `tar` in `files`."""
    env = fresh_env(
        work / "cog-home", BUNDLE_CACHE_DIR=str(cog_cache(work)), COG_WEIGHTS=files.url(tar), **extra
    )
    return boot_cog(name, env, work, timeout_s)


def part_cog(work: Path, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    model = Path(resolve_model_path(Settings()))  # a test fixture, built before any boot is timed
    files = Files(work / "http")
    try:
        (files.folder / "weights.tar").write_bytes(weights_tar(model))
        boots = {"cog-empty": boot_cog_from("cog-empty", files, "weights.tar", work, timeout_s)}
        packs = {"cog": make_pack(cog_cache(work) / ROOT_NAME, work / "cog-pack.tar")}
        (files.folder / "weights-cache.tar").write_bytes(weights_tar(model, work / "cog-pack.tar"))
        boots["cog-pack"] = boot_cog_from("cog-pack", files, "weights-cache.tar", work, timeout_s)
    finally:
        files.close()
    return boots, packs


def part_rest(work: Path, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    if not (work / "cog-pack.tar").is_file():
        raise SystemExit(f"no {work / 'cog-pack.tar'}: run --part cog with this --work first")
    files = Files(work / "http")
    try:
        mismatched(work / "cog-pack.tar", files.folder / "mismatch.tar")
        boots = {
            "cog-mismatch": boot_cog_from(
                "cog-mismatch",
                files,
                "weights.tar",
                work,
                timeout_s,
                BUNDLE_COMPILE_CACHE=files.url("mismatch.tar"),
            )
        }
    finally:
        files.close()
    root = work / "serve-root"
    shutil.rmtree(root, ignore_errors=True)
    # The built-in model stays where it was built (a test fixture, not part of a cold start).
    model_home = str(Settings().cache_dir)
    env = fresh_env(work / "serve-home", BUNDLE_CACHE_DIR=model_home, BUNDLE_COMPILE_CACHE_DIR=str(root))
    boots["serve-empty"] = boot_serve("serve-empty", env, work, timeout_s)
    packs = {"serve": make_pack(root, work / "serve-pack.tar")}
    shutil.rmtree(root)
    env = fresh_env(
        work / "serve-home",
        BUNDLE_CACHE_DIR=model_home,
        BUNDLE_COMPILE_CACHE_DIR=str(root),
        BUNDLE_COMPILE_CACHE=str(work / "serve-pack.tar"),
    )
    boots["serve-pack"] = boot_serve("serve-pack", env, work, timeout_s)
    return boots, packs


def part_again(work: Path, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
    files = Files(work / "http")
    needed = [work / "cog-pack.tar", files.folder / "weights.tar", files.folder / "weights-cache.tar"]
    if missing := [str(path) for path in needed if not path.is_file()]:
        files.close()
        raise SystemExit(f"no {', '.join(missing)}: run --part cog with this --work first")
    index = 2
    while (work / f"cog-empty-{index}.log").exists():
        index += 1
    try:
        boots = {
            name: boot_cog_from(name, files, tar, work, timeout_s)
            for name, tar in ((f"cog-empty-{index}", "weights.tar"), (f"cog-pack-{index}", "weights-cache.tar"))
        }
    finally:
        files.close()
    return boots, {}


# --- the report ---------------------------------------------------------------------------------------------
def runs_of(boots: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """The boots of one kind: `kind` itself and its repeats `kind-2`, `kind-3`, ..."""
    return [boot for name, boot in boots.items() if is_boot_of(name, kind)]


def median_ready(boots: dict[str, Any], kind: str) -> float:
    return round(statistics.median(boot["ready_s"] for boot in runs_of(boots, kind)), 2)


def checks(boots: dict[str, Any]) -> dict[str, Any]:
    """What issue 38 asks to be shown, for the boots present."""
    found: dict[str, Any] = {}
    for pack, empty in (
        ("cog-pack", "cog-empty"),
        ("cog-mismatch", "cog-empty"),
        ("serve-pack", "serve-empty"),
    ):
        if pack in boots and empty in boots:
            found[f"{pack}_same_greedy_text"] = all(
                boot.get("greedy") == boots[empty].get("greedy") for boot in runs_of(boots, pack)
            )
    for name in ("cog-pack", "serve-pack"):
        if name in boots:
            found[f"{name}_used"] = any(": used, " in line for line in boots[name].get("pack_lines", []))
    if "cog-mismatch" in boots:
        said = boots["cog-mismatch"].get("pack_lines", [])
        refusals = [line for line in said if "not used" in line]
        found["cog-mismatch_one_line"] = len(refusals) == 1 and "made for another start" in refusals[0]
        if "cog-empty" in boots:
            slower = boots["cog-mismatch"]["ready_s"] / max(median_ready(boots, "cog-empty"), 1e-9)
            found["cog-mismatch_ready_vs_empty"] = round(slower, 3)
            found["cog-mismatch_not_slower"] = slower <= NOT_SLOWER_SLACK
    found["bars_s"] = {name: judged(boots, name, bar) for name, bar in BARS_S.items() if name in boots}
    return found


def judged(boots: dict[str, Any], kind: str, bar: float) -> dict[str, Any]:
    """One bar against the median boot of its kind, every boot's figure beside it."""
    median = median_ready(boots, kind)
    return {
        "bar": bar,
        "ready_s": [boot["ready_s"] for boot in runs_of(boots, kind)],
        "median_s": median,
        "met": median <= bar,
    }


def report(args: argparse.Namespace, boots: dict[str, Any], packs: dict[str, Any]) -> dict[str, Any]:
    path = args.out / "coldboot.json"
    earlier = json.loads(path.read_text()) if args.merge and path.exists() else {}
    boots = {**earlier.get("boots", {}), **boots}
    for boot in boots.values():
        if "greedy" in boot:
            boot["greedy_sha256"] = hashlib.sha256(json.dumps(boot["greedy"]).encode()).hexdigest()
    return {
        "schema": SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "commands": [*earlier.get("commands", []), "python -m bench.coldboot " + " ".join(args.argv)],
        "machine": args.machine or machine(),
        "vllm": vllm_version(),
        "model": Settings().model_name,
        "engine_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("BUNDLE_")},
        "boots": boots,
        "packs": {**earlier.get("packs", {}), **packs},
        "checks": checks(boots),
    }


def markdown(result: dict[str, Any]) -> str:
    """One table: a column per boot, a row per phase (seconds from the previous milestone seen),
    then the roll-up the issue's table uses and seconds to ready."""
    boots = result["boots"]
    names = list(boots)
    order = [name for name, _ in COG_MILESTONES] + [name for name in PHASES if name not in dict(COG_MILESTONES)]
    seen = {p for boot in boots.values() for p in boot.get("phases", {})}
    phases_seen = [name for name in order if name in seen] + sorted(seen - set(order))
    rollups = list(dict.fromkeys(r for boot in boots.values() for r in boot.get("rollup", {})))
    lines = [
        f"Cold boots, {result['model']} on {_where(result['machine'])}, vLLM {result['vllm']}",
        "",
        "| phase (s) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for phase in phases_seen:
        lines.append(
            f"| {phase} | " + " | ".join(_cell(boots[n].get("phases", {}).get(phase)) for n in names) + " |"
        )
    for name in rollups:
        lines.append(
            f"| *{name}* | " + " | ".join(_cell(boots[n].get("rollup", {}).get(name)) for n in names) + " |"
        )
    lines.append("| **ready** | " + " | ".join(f"**{_cell(boots[n]['ready_s'])}**" for n in names) + " |")
    lines.append(
        "\nCog: from coglet's spawn to READY (GET /health-check, polled every 0.5 s); serve: to /health 200."
    )
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _where(machine: Any) -> str:
    return machine if isinstance(machine, str) else str(machine.get("gpu") or machine.get("cpu"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.coldboot", description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=PARTS, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/coldboot"), help="homes, logs, packs")
    parser.add_argument("--out", type=Path, required=True, help="writes coldboot.json")
    parser.add_argument(
        "--merge", action="store_true", help="keep the other boots of an existing coldboot.json"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one boot may take to be ready")
    parser.add_argument("--machine", default="", help="a description for the report (default: this machine)")
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.work.mkdir(parents=True, exist_ok=True)
    part = {"cog": part_cog, "rest": part_rest, "again": part_again}[args.part]
    boots, packs = part(args.work, args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    result = report(args, boots, packs)
    (args.out / "coldboot.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "coldboot.md").write_text(markdown(result))
    print(
        json.dumps(
            {"ready_s": {k: v["ready_s"] for k, v in result["boots"].items()}, "checks": result["checks"]}
        )
    )
    return 0 if all(v for k, v in result["checks"].items() if isinstance(v, bool)) else 1


def _say(message: str) -> None:
    print(f"[coldboot] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
