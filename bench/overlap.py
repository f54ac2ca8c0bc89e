"""What the Cog runner's setup saves by importing vLLM while its weights download.

    python -m bench.overlap --out results/cpu/overlap [--runs 3 --mib 64 --rate-mib-s 6]

A local HTTP server serves a weights tar (the tiny model, padded to --mib MiB) at --rate-mib-s,
so that its download takes seconds, as a real model's does from a CDN (minutes there). Each run
is a fresh interpreter (vLLM not imported yet, an empty cache folder) that does what setup()
waits for before the engine can start, timed from its first line:

  sequential  the weights (download, unpack), then vLLM's import: the order setup() had;
  overlapped  `shared.assembly.prepare_start`, what setup() calls now: both at once.

Runs alternate between the two, so neither gets the warmer page cache. The server answers
every request whole (no Range), so the download is one stream at the set rate. Writes
OUT/overlap.json with every run, the medians, the saving and the command that made it.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SCHEMA = "bundle-overlap/1"
MODES = ("sequential", "overlapped")
CHUNK = 64 * 1024


# --- the child: one setup's wait, in a fresh interpreter --------------------------------------------
def child(mode: str, url: str, cache: Path) -> dict[str, Any]:
    started = time.monotonic()
    from shared.assembly import prepare_start, with_weights
    from shared.engine.vllm_startup import import_engine_modules
    from shared.settings import Settings

    settings = Settings(cache_dir=cache)
    if mode == "sequential":
        resolved = with_weights(settings, url)
        weights_s = time.monotonic() - started
        import_engine_modules()
    else:
        resolved = asyncio.run(prepare_start(settings, url))
        weights_s = None
    assert Path(resolved.model, "config.json").is_file()
    return {"mode": mode, "ready_s": round(time.monotonic() - started, 3), "weights_s": weights_s}


# --- the server ---------------------------------------------------------------------------------------
def weights_tar(mib: int) -> bytes:
    """The tiny model's folder plus a file of random bytes, `mib` MiB in all (about)."""
    from shared.engine.vllm_startup import resolve_model_path
    from shared.settings import Settings

    model = Path(resolve_model_path(Settings()))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(model.iterdir()):
            tar.add(path, arcname=f"model/{path.name}")
        padding = os.urandom(max(0, mib * 1024 * 1024 - buffer.tell()))
        info = tarfile.TarInfo("model/padding.bin")
        info.size = len(padding)
        tar.addfile(info, io.BytesIO(padding))
    return buffer.getvalue()


@contextmanager
def throttled_server(body: bytes, rate_bytes_s: float) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
            self.send_response(200)  # Range ignored: one stream at the set rate
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            began = time.monotonic()
            try:
                for offset in range(0, len(body), CHUNK):
                    self.wfile.write(body[offset : offset + CHUNK])
                    ahead = (offset + CHUNK) / rate_bytes_s - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the fetcher's first request reads the headers only (its size probe)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/weights.tar"
    finally:
        server.shutdown()
        server.server_close()


# --- the parent -----------------------------------------------------------------------------------------
def run(mode: str, url: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bundle-overlap-") as cache:
        command = [sys.executable, "-m", "bench.overlap", "--child", mode, "--url", url, "--cache", cache]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(runs: int, mib: int, rate_mib_s: float) -> dict[str, Any]:
    body = weights_tar(mib)
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with throttled_server(body, rate_mib_s * 1024 * 1024) as url:
        for index in range(runs):
            order = MODES if index % 2 == 0 else MODES[::-1]
            for mode in order:
                results[mode].append(run(mode, url))
                print(f"{mode} run {index + 1}: {results[mode][-1]}", file=sys.stderr, flush=True)
    medians = {mode: statistics.median(r["ready_s"] for r in results[mode]) for mode in MODES}
    weights = statistics.median(r["weights_s"] for r in results["sequential"])
    return {
        "tar_mib": round(len(body) / 1024 / 1024, 1),
        "rate_mib_s": rate_mib_s,
        "runs": results,
        "median_ready_s": {mode: round(value, 2) for mode, value in medians.items()},
        "median_weights_alone_s": round(weights, 2),
        "median_import_alone_s": round(medians["sequential"] - weights, 2),
        "saved_s": round(medians["sequential"] - medians["overlapped"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/cpu/overlap"))
    parser.add_argument("--runs", type=int, default=3, help="runs per mode, alternating")
    parser.add_argument("--mib", type=int, default=64, help="size of the weights tar")
    parser.add_argument("--rate-mib-s", type=float, default=6.0, help="download rate the server keeps")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.url, args.cache)))
        return 0
    if args.runs < 1 or args.mib < 1 or args.rate_mib_s <= 0:
        parser.error("--runs and --mib must be at least 1, --rate-mib-s above 0")
    from bench.startup import machine, vllm_version

    report = {
        "schema": SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.overlap " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "vllm": vllm_version(),
        **measure(args.runs, args.mib, args.rate_mib_s),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("median_ready_s", "median_weights_alone_s", "saved_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
