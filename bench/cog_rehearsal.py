"""The Cog runner as Replicate runs it, measured, then the bundle's HTTP server on the same load.

    python3 -m bench.cog_rehearsal --out DIR [--concurrency 32 --rounds 3 --rate 8 ...]

1. coglet (`python -m cog.server.http`) serving cog/predict.py:Runner with COG_MAX_CONCURRENCY
   slots; setup time to READY (GET /health-check), stopping at once on SETUP_FAILED or a dead
   process, never waiting out the timeout for nothing;
2. one streaming prediction; `concurrency` streams in a closed loop (`rounds` x concurrency
   predictions, each client sending its next one as its stream ends); an open loop (Poisson
   arrivals at `rate`/s for `open_seconds`); 409 "at capacity" answers counted apart;
3. a cancel mid-stream (then vLLM's running requests must reach 0: the runner reports them in
   every prediction's metrics); one request_id twice at once (one generation: same text);
4. coglet stopped, `python -m shared.serve` started on the same settings and given the same
   prompts and lengths (chat completions, streamed).
Writes DIR/cog.json, DIR/coglet.log and DIR/serve.log. Exit 1 when the runner did not start.

Coglet starts its worker as plain `python` from PATH: a `python` that is this interpreter
(with this PYTHONPATH) is put first on PATH. Cog inputs have no `ignore_eos`, so both targets
run without it and their output is counted from the text; a random-weight model rarely stops
early, and the counts are in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import cog_requests as cr
from bench.loadgen import run_level
from bench.requesters import load_client
from bench.servers import bundle_command, free_port, running_server
from bench.workload import Workload
from shared.engine.vllm_startup import resolve_model_path
from shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
RUNNER = "cog/predict.py:Runner"
HEALTH_POLL_S = 0.5
# vLLM's own start-up phase lines (bench/startup.py parses the same ones), kept from each log so
# that the two targets' set-up times can be taken apart.
PHASE_LINE = re.compile(
    r"(Model loading took|Loading weights took|torch\.compile (?:took|takes)|Graph capturing finished|"
    r"init engine \(.*\) took)[^\"\n]*"
)
CANCEL_AFTER_CHUNKS = 8
JIT_LINE = re.compile(r"Triton kernel JIT compilation during inference: (\w+)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m bench.cog_rehearsal", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop streams")
    p.add_argument("--slots", type=int, default=0, help="COG_MAX_CONCURRENCY; 0: = concurrency")
    p.add_argument("--rounds", type=int, default=3, help="closed loop: concurrency x rounds predictions")
    p.add_argument("--rate", type=float, default=8.0, help="open loop: predictions per second")
    p.add_argument("--open-seconds", type=float, default=10.0)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=256, help="max_tokens of every request")
    p.add_argument("--setup-timeout", type=float, default=300.0)
    p.add_argument(
        "--retry-409-ms", type=float, default=20.0, help="Cog: a second closed loop whose clients retry a 409"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-http", action="store_true", help="coglet only")
    p.add_argument("--machine", default="")
    args = p.parse_args(argv)
    for name in ("concurrency", "rounds", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.slots = args.slots or args.concurrency
    return args


class Texts:
    """Prompt token ids -> text (the model's tokenizer), and text -> its token count."""

    def __init__(self, settings: Settings) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings))

    @property
    def vocab(self) -> int:
        return int(self.tokenizer.vocab_size)

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


# --- coglet ------------------------------------------------------------------------------------
def python_on_path(folder: Path) -> dict[str, str]:
    """PATH and PYTHONPATH for coglet: its worker is started as `python` (a shell script here,
    not a symlink, so that a virtualenv's interpreter still finds its pyvenv.cfg)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python"
    pythonpath = os.environ.get("PYTHONPATH", "")
    script.write_text(f'#!/bin/sh\nPYTHONPATH="{pythonpath}" exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ.get('PATH', '')}", "PYTHONPATH": pythonpath}


@contextlib.contextmanager
def coglet(
    port: int, slots: int, log: Path, work: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """coglet serving the runner; `env` (default: this process's) is the server's environment."""
    env = {
        **(os.environ if env is None else env),
        **python_on_path(work / "bin"),
        "COG_PREDICT_TYPE_STUB": RUNNER,
        "COG_MAX_CONCURRENCY": str(slots),
        "PORT": str(port),
    }
    with log.open("wb") as out:
        # Its own process group (the worker and vLLM's engine die with it), not its own session
        # (a session is its own CPU group under autogroup scheduling; see docs/cog.md).
        process = subprocess.Popen(
            [sys.executable, "-m", "cog.server.http", "--host", "127.0.0.1"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, process_group=0,
        )  # fmt: skip
        try:
            yield process
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((15, 30), (9, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait_s)
            return


def wait_setup(
    url: str, process: subprocess.Popen[bytes], timeout_s: float
) -> tuple[str, float, dict[str, Any]]:
    """(READY | SETUP_FAILED | exited N | timeout, seconds, coglet's last answer)."""
    started = time.monotonic()
    answer: dict[str, Any] = {}
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            return f"exited {process.returncode}", time.monotonic() - started, answer
        with contextlib.suppress(httpx.HTTPError, ValueError):
            answer = httpx.get(f"{url}/health-check", timeout=5).json()
        if answer.get("status") in ("READY", "SETUP_FAILED"):
            return str(answer["status"]), time.monotonic() - started, answer
        time.sleep(HEALTH_POLL_S)
    return "timeout", time.monotonic() - started, answer


# --- the load, for either target -----------------------------------------------------------------
async def run_loads(
    url: str, send: Callable[[Any, str], Any], workload: Workload, texts: Texts, args: argparse.Namespace
) -> dict[str, Any]:
    """Warm-up, one stream, the closed loop and the open loop against one target."""
    results: dict[str, Any] = {}
    async with load_client(url) as client:
        one = cr.requester(partial(send, client), texts.text, texts.count)
        await one(workload.prompts(1, "warm-up")[0])
        results["one"] = await run_level(one, workload.prompts(3, "one"), 1)
        closed = workload.prompts(args.concurrency * args.rounds, "closed")
        results["closed"] = at_capacity(await run_level(one, closed, args.concurrency))
        opened = Workload(**{**vars(workload), "request_rate": args.rate})
        prompts = opened.prompts(max(1, round(args.rate * args.open_seconds)), "open")
        results["open"] = at_capacity(
            await run_level(one, prompts, args.slots, opened.arrival_offsets(prompts))
        )
    return results


def at_capacity(level: dict[str, Any]) -> dict[str, Any]:
    level["at_capacity_409"] = sum(
        n for kind, n in level["error_kinds"].items() if kind.startswith(cr.AT_CAPACITY)
    )
    return level


async def closed_with_retry(
    url: str, send: Callable[[Any, str], Any], workload: Workload, texts: Texts, args: argparse.Namespace
) -> dict[str, Any]:
    """The closed loop again (fresh prompts), each client retrying a 409 after a short wait."""
    retries: dict[str, int] = {}
    async with load_client(url) as client:
        again = cr.retrying_409(partial(send, client), args.retry_409_ms / 1000, retries)
        one = cr.requester(again, texts.text, texts.count)
        prompts = workload.prompts(args.concurrency * args.rounds, "closed-retry")
        level = at_capacity(await run_level(one, prompts, args.concurrency))
    return {**level, "retry_wait_ms": args.retry_409_ms, "retries_after_409": retries.get("409", 0)}


async def cog_checks(url: str, args: argparse.Namespace) -> dict[str, Any]:
    long_input = {
        "prompt": "Tell me a long story.",
        "max_tokens": max(64, args.output_tokens),
        "temperature": 1.0,
    }
    async with load_client(url) as client:
        cancel = await cr.cancel_mid_stream(client, long_input, CANCEL_AFTER_CHUNKS)
        same = await cr.same_request_id_twice(client, {**long_input, "max_tokens": 32})
    return {"cancel": cancel, "same_request_id": same}


async def cog_token_source(url: str) -> str:
    """Where the Cog figures' token counts come from: the runner's own count when its
    predictions report one, else the streamed text encoded again (approximate: decoding then
    encoding random-token text does not give back the same number of tokens)."""
    async with load_client(url) as client:
        stream = await cr.cog_stream(client, {"prompt": "ping", "max_tokens": 2})
    return "metric output_token_count" if stream.tokens is not None else "text encoded again"


def cog_sender(max_tokens: int) -> Callable[[Any, str], Any]:
    def send(client: Any, text: str) -> Any:
        return cr.cog_stream(client, {"prompt": text, "max_tokens": max_tokens, "temperature": 1.0})

    return send


def chat_sender(model: str, max_tokens: int) -> Callable[[Any, str], Any]:
    def send(client: Any, text: str) -> Any:
        return cr.chat_stream(client, model, text, max_tokens)

    return send


# --- the two targets ------------------------------------------------------------------------------
def compile_cache_entries() -> int:
    """Entries in vLLM's torch.compile cache before coglet starts: its setup time includes the
    compilation when 0 (the HTTP server, started second, then finds the cache warm)."""
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "torch_compile_cache"
    return sum(1 for _ in root.iterdir()) if root.is_dir() else 0


def rehearse_cog(args: argparse.Namespace, workload: Workload, texts: Texts) -> dict[str, Any]:
    port = free_port()
    cache_before = compile_cache_entries()
    url = f"http://127.0.0.1:{port}"
    log = args.out / "coglet.log"
    with tempfile.TemporaryDirectory() as work, coglet(port, args.slots, log, Path(work)) as process:
        status, setup_s, answer = wait_setup(url, process, args.setup_timeout)
        report: dict[str, Any] = {"status": status, "setup_s": round(setup_s, 2), "slots": args.slots}
        report["compile_cache_entries_before"] = cache_before
        report["vllm_phases"] = phase_lines(log)
        # cog/child_output.py's line from each child forked in coglet's worker (vLLM's
        # engine core on GPUs; none on CPU, where vLLM spawns it).
        report["forked_children"] = _count(log, "forked from coglet's worker")
        _log(f"cog: {status} after {setup_s:.1f} s")
        if status != "READY":
            report["health_check"] = answer
            return report
        send = cog_sender(args.output_tokens)
        report.update(asyncio.run(run_loads(url, send, workload, texts, args)))
        report["closed_retry_409"] = asyncio.run(closed_with_retry(url, send, workload, texts, args))
        report.update(asyncio.run(cog_checks(url, args)))
        report["output_tokens_from"] = asyncio.run(cog_token_source(url))
    report["triton_jit_in_inference"] = jit_compiles(log)
    return report


def rehearse_http(
    args: argparse.Namespace, workload: Workload, texts: Texts, settings: Settings
) -> dict[str, Any]:
    port = free_port()
    started = time.monotonic()
    with running_server(bundle_command(port), port, args.out / "serve.log", dict(os.environ)):
        setup_s = time.monotonic() - started
        _log(f"http: healthy after {setup_s:.1f} s")
        send = chat_sender(settings.model_name, args.output_tokens)
        loads = asyncio.run(run_loads(f"http://127.0.0.1:{port}", send, workload, texts, args))
    return {"setup_s": round(setup_s, 2), "vllm_phases": phase_lines(args.out / "serve.log"), **loads}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = Settings()
    texts = Texts(settings)
    workload = Workload(args.prompt_tokens, args.output_tokens, min(texts.vocab, 128_000), args.seed)
    report: dict[str, Any] = {
        "machine": args.machine,
        "load": _load(args),
        "cog": rehearse_cog(args, workload, texts),
    }
    _write(args.out, report)
    if report["cog"]["status"] != "READY":
        _log(f"the runner did not start; see {args.out / 'coglet.log'}")
        return 1
    if not args.skip_http:
        report["http"] = rehearse_http(args, workload, texts, settings)
        _write(args.out, report)
    _log(f"wrote {args.out / 'cog.json'}")
    return 0


def phase_lines(log: Path) -> list[str]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [found.group(0)[:160] for found in PHASE_LINE.finditer(text)]


def jit_compiles(log: Path) -> dict[str, list[str]]:
    """vLLM's (GPU build) own warnings of Triton kernels compiled while serving, split at coglet's
    "Setup complete": in setup (the runner's warm-up, harmless) or after (a prediction waited)."""
    found: dict[str, list[str]] = {"setup": [], "after_ready": []}
    phase = "setup"
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return found
    for line in lines:
        if "Setup complete" in line:
            phase = "after_ready"
        elif (kernel := JIT_LINE.search(line)) is not None:
            found[phase].append(kernel.group(1))
    return found


def _count(log: Path, text: str) -> int:
    try:
        return log.read_text(errors="replace").count(text)
    except OSError:
        return 0


def _load(args: argparse.Namespace) -> dict[str, Any]:
    keys: tuple[str, ...] = ("concurrency", "slots", "rounds", "rate", "open_seconds", "prompt_tokens")
    keys += ("output_tokens", "seed", "retry_409_ms")
    # Both servers inherit it (coglet passes its environment to its worker): e.g. "spawn" to
    # compare against the default fork.
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "vLLM's default")
    return {**{key: getattr(args, key) for key in keys}, "vllm_worker_multiproc_method": method}


def _write(out: Path, report: dict[str, Any]) -> None:
    (out / "cog.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


def _log(message: str) -> None:
    print(f"[cog-rehearsal] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
