"""Who holds the server's port, and is it refused during a drain? (`python -m shared.serve`)

    python -m bench.listener --out DIR [--api-processes N]   # bash bench/gpu.sh listener; ~1-2 min

`python -m shared.serve` binds its port before vLLM's engine starts (shared/serve.py,
`claim_port`). On CUDA vLLM forks its engine core, and a forked child's copy of the listening socket
would keep the port listening after the server closed it: connections made during a drain would
queue unanswered instead of being refused. The CPU build spawns its engine core, so only a GPU run
shows this. The check: start the server (eager, to be quick; with N API processes, the
supervisor binds one socket per process before the engine core starts), list every process
holding a socket listening on the port, hold one long stream, send SIGTERM to the server, and
during the drain try new connections. Writes DIR/listener-N.json; exit 1 unless each listening
socket is held by one process alone (its API process) and the connections made during the drain
were refused.
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


def listening_inodes(port: int) -> list[str]:
    """The sockets listening on `port`: one, or one per API process (SO_REUSEPORT)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == LISTEN:
                    found.append(fields[9])
    return found


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


def check(work: Path, api_processes: int) -> dict[str, Any]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BUNDLE_ENFORCE_EAGER": "true",
        "BUNDLE_SHUTDOWN_GRACE_S": str(GRACE_S),
        "BUNDLE_API_PROCESSES": str(api_processes),
    }
    log = LogCapture(work / f"listener-server-{api_processes}.log")
    with spawned_server(env, port, log) as (process, _):
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process, 600)
        group = group_pids(process.pid)
        held_by = {inode: holders(inode, group) for inode in listening_inodes(port)}
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
        "api_processes": api_processes,
        "port": port,
        "processes_in_group": len(group),
        "holders": held_by,
        # one listening socket per API process, each held by that process alone
        "held_by_the_api_processes_alone": len(held_by) == api_processes
        and all(len(found) == 1 for found in held_by.values()),
        "refused_during_drain": during_drain,
        "drain_was_running": drain_running,
        "exit_code": process.returncode,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.listener", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="writes listener-N.json and the server's log")
    parser.add_argument("--api-processes", type=int, default=1, help="BUNDLE_API_PROCESSES (default 1)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **check(args.out, args.api_processes),
    }
    (args.out / f"listener-{args.api_processes}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    ok = result["held_by_the_api_processes_alone"] and result["drain_was_running"]
    return 0 if ok and all(result["refused_during_drain"]) else 1


if __name__ == "__main__":
    sys.exit(main())
