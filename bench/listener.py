"""Who holds the server's port, and is it refused during a drain? (`python -m shared.serve`)

    python -m bench.listener --out DIR      # bash bench/gpu.sh listener on the H200; ~1-2 min

`python -m shared.serve` binds its port before vLLM's engine starts (shared/serve.py,
`claim_port`). On CUDA vLLM forks its engine core, and a forked child's copy of the listening socket
would keep the port listening after the server closed it: connections made during a drain would
queue unanswered instead of being refused. The CPU build spawns its engine core, so only a GPU run
shows this. The check: start the server (eager, to be quick), list every process holding the
listening socket, hold one long stream, send SIGTERM to the API process, and during the drain
try new connections. Writes DIR/listener.json; exit 1 if a process other than the API one holds
the port or a connection made during the drain was not refused.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.servers import free_port, wait_healthy
from bench.startup import LogCapture, machine, spawned_server
from shared.settings import Settings

LISTEN = "0A"  # the LISTEN state in /proc/net/tcp
GRACE_S = 30  # the drain the server is given: long enough to try connections inside it


def listening_inode(port: int) -> str | None:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == LISTEN:
                    return fields[9]
    return None


def group_pids(group: int) -> list[int]:
    """The live processes of process group `group`."""
    pids = []
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        try:
            if os.getpgid(pid) == group:
                pids.append(pid)
        except OSError:  # gone meanwhile
            continue
    return sorted(pids)


def holders(inode: str, pids: list[int]) -> list[dict[str, Any]]:
    """The processes among `pids` with the socket `inode` among their descriptors."""
    found = []
    for pid in pids:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"socket:[{inode}]" in links:
            found.append({"pid": pid, "name": name})
    return found


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout: the connection queued, unanswered
        return False
    return False


def hold_a_stream(base: str, model: str, started: threading.Event) -> None:
    body = {"model": model, "prompt": "Count on:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=GRACE_S + 60) as response:
            for _ in response.iter_lines():
                started.set()
    except httpx.HTTPError:
        pass  # ended by the drain: what the check is about is the port, not this stream
    finally:
        started.set()


def check(work: Path) -> dict[str, Any]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BUNDLE_ENFORCE_EAGER": "true",
        "BUNDLE_SHUTDOWN_GRACE_S": str(GRACE_S),
    }
    log = LogCapture(work / "listener-server.log")
    with spawned_server(env, port, log) as (process, _):
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process, 600)
        inode = listening_inode(port)
        group = group_pids(process.pid)
        held_by = holders(inode, group) if inode else []
        started = threading.Event()
        stream = threading.Thread(
            target=hold_a_stream, args=(base, Settings().model_name, started), daemon=True
        )
        stream.start()
        started.wait(120)
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(1.0)  # the server closes its socket at once on the signal
        during_drain = [refused(port) for _ in range(3)]
        drain_running = process.poll() is None
        process.wait(GRACE_S + 90)
        stream.join(10)
    return {
        "port": port,
        "processes_in_group": len(group),
        "holders": held_by,
        "only_the_api_process_holds_it": [h["pid"] for h in held_by] == [process.pid],
        "refused_during_drain": during_drain,
        "drain_was_running": drain_running,
        "exit_code": process.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.listener", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="writes listener.json and the server's log")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **check(args.out),
    }
    (args.out / "listener.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    ok = (
        result["only_the_api_process_holds_it"]
        and all(result["refused_during_drain"])
        and result["drain_was_running"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
