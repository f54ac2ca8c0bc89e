"""What one streamed event's socket write costs the serving process, and nothing else.

    python -m bench.loopback_writes --connections 256 --out results/h200/profile/loopback.json

The benchmark's clients run on the server's machine, so every SSE event the bundle sends is a
TCP write over loopback, and the kernel does the receiving side's TCP work in the sending
thread's time as well. This measures that floor on its own: one process holds `--connections`
accepted connections as transports of the event loop the server uses (uvloop when installed,
as in the deploy images) and, every `--step-ms` (an engine step at that many streams), writes
one event of `--bytes` to each, as a direct write does; a second process reads them all. The
writer's CPU time over the write loops, per write, is the least that a server writing one event
per stream per step can spend per event here, before any Python of its own; what the reader
spends is reported beside it (in production that is another machine).
"""

from __future__ import annotations

import argparse
import asyncio
import selectors
import socket
import sys
import time
from pathlib import Path
from typing import Any

import orjson

# A completions chunk as the benchmark's streams carry it: `data: {...}` with a cmpl id, the
# model's name and a one-token text, plus the chunked-encoding frame around it.
DEFAULT_EVENT_BYTES = 190


class _Silent(asyncio.Protocol):
    """The writer's side of a connection: it only writes; whatever arrives is ignored."""

    def data_received(self, data: bytes) -> None:
        pass


def read_all(port: int, connections: int) -> None:
    """The reader process: connect, drain every connection to its end, print its CPU seconds."""
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    selector = selectors.DefaultSelector()
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, data=sock)
    open_count = len(sockets)
    while open_count:
        for key, _ in selector.select():
            sock = key.data
            if not sock.recv(1 << 16):
                selector.unregister(sock)
                sock.close()
                open_count -= 1
    print(time.process_time(), flush=True)


async def write_rounds(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0), backlog=args.connections)
    port = listener.getsockname()[1]
    reader = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bench.loopback_writes", "--read", str(port)),
        *("--connections", str(args.connections)),
        stdout=asyncio.subprocess.PIPE,
    )
    transports = []
    try:
        for _ in range(args.connections):
            sock, _ = await loop.sock_accept(listener)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as uvicorn sets it
            transport, _ = await loop.connect_accepted_socket(_Silent, sock)
            transports.append(transport)
        event = _framed_event(args.bytes)
        writing_s = 0.0
        for _ in range(args.rounds):
            started = time.thread_time()
            for transport in transports:
                transport.write(event)
            writing_s += time.thread_time() - started
            await asyncio.sleep(args.step_ms / 1000)
    finally:
        for transport in transports:
            transport.close()
        listener.close()
    # The loop must keep turning for the transports to flush and close: the reader sees each end.
    reader_out, _ = await asyncio.wait_for(reader.communicate(), 60)
    reader_cpu_s = float(reader_out.strip() or "nan")
    writes = args.rounds * args.connections
    return {
        "schema": "bundle-loopback-writes/1",
        "event_loop": type(loop).__module__,
        "connections": args.connections,
        "rounds": args.rounds,
        "event_bytes": len(event),
        "step_ms": args.step_ms,
        "writer_cpu_ms_per_write": 1000 * writing_s / writes,
        "reader_cpu_ms_per_write": 1000 * reader_cpu_s / writes,
    }


def _framed_event(total_bytes: int) -> bytes:
    """A chunk of `total_bytes` with its chunked-encoding frame (hex length, CRLFs) included."""
    payload = total_bytes - 4
    while len(b"%x" % payload) + payload + 4 > total_bytes:
        payload -= 1
    return b"%x\r\n%s\r\n" % (payload, b"x" * payload)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loopback_writes", description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=256)
    p.add_argument("--rounds", type=int, default=400, help="writes per connection")
    p.add_argument("--bytes", type=int, default=DEFAULT_EVENT_BYTES, help="one event with its chunk frame")
    p.add_argument("--step-ms", type=float, default=26.0, help="between rounds (an engine step)")
    p.add_argument("--out", help="write the result here as JSON")
    p.add_argument("--read", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the reader process
    args = p.parse_args(argv)
    if args.read is not None:
        read_all(args.read, args.connections)
        return 0
    if args.bytes < 16 or args.connections < 1 or args.rounds < 1:
        p.error("--bytes must be at least 16, --connections and --rounds at least 1")
    result = _run(write_rounds(args))
    line = (
        f"{result['connections']} connections, {result['event_bytes']} B per write, {result['event_loop']}: "
        f"writer {result['writer_cpu_ms_per_write'] * 1000:.1f} us CPU per write, "
        f"reader {result['reader_cpu_ms_per_write'] * 1000:.1f} us"
    )
    print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


def _run(main_coroutine: Any) -> Any:
    """On uvloop where it is installed (the deploy images' loop), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_coroutine)
    return uvloop.run(main_coroutine)


if __name__ == "__main__":
    sys.exit(main())
