"""One engine core for N API processes, through vLLM's own multi-API-server machinery.

`vllm serve --api-server-count N` (vllm/entrypoints/cli/serve.py, `run_multi_api_server`) makes
one pair of ZMQ endpoints per API process, starts the engine core on those addresses
(`launch_core_engines`), starts the API processes (`APIServerProcessManager`), and each builds
an `AsyncLLM` on its own pair (`client_addresses`, `client_count`, `client_index`). The bundle
does the same, with its own API process as the target (shared/procs/worker.py). The endpoints
change hands in one of two ways, by release:

- "listeners" (vLLM 0.32 on, the CPU build the tests run): the supervisor binds raw listening
  sockets (`bind_engine_zmq_listeners`) and each API process adopts its pair;
  `launch_core_engines` yields a `CoreEngineLaunch`.
- "addresses" (vLLM 0.26, the H200's GPU build): endpoint templates (`get_engine_zmq_addresses`);
  each API process binds its own pair and reports it through a pipe, which the supervisor reads
  (`gather_actual_addresses`) before the engine's handshake; `launch_core_engines` yields a tuple.

The path taken is logged when the engine starts.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from shared.engine.vllm_startup import engine_args
from shared.settings import Settings

log = logging.getLogger(__name__)

# Target of each API process: (listen address, socket, spec, client config), as vLLM calls it.
ApiTarget = Callable[[str, Any, Any, dict[str, Any]], None]
# The spec handed to every API process, made once the engine core's pids are known.
SpecMaker = Callable[[list[int]], Any]


@dataclass
class Launched:
    """The processes, once the engine core is up and every API process is starting."""

    path: str  # "listeners" or "addresses"
    api_processes: list[BaseProcess]
    engine_processes: list[BaseProcess]
    # vLLM's bound endpoints: held for the server's life, as `vllm serve` holds them (collected,
    # they would unlink their IPC paths under the engine's connections).
    endpoints: Any = None


def launch_path() -> str:
    """Which of the two ways this vLLM hands the endpoints over (module docstring)."""
    import vllm.v1.engine.utils as utils

    return "listeners" if hasattr(utils, "bind_engine_zmq_listeners") else "addresses"


def engine_config(settings: Settings, count: int) -> Any:
    """The engine's `VllmConfig`, as `vllm serve` makes it for `count` API processes (rank -1:
    the supervisor, no API process of its own)."""
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    args = engine_args(settings, on_cpu=current_platform.is_cpu())
    args._api_process_count = count
    args._api_process_rank = -1
    return args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


@contextlib.contextmanager
def launch(settings: Settings, count: int, target: ApiTarget, make_spec: SpecMaker) -> Iterator[Launched]:
    """Start the engine core and `count` API processes; on leaving, stop whatever still runs:
    API processes first (bounded by `shutdown_grace_s`), then the engine core, with vLLM's own
    bound as when one API process stops the core it started."""
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager

    path = launch_path()
    config = engine_config(settings, count)
    log.info("%d API processes on one engine core (vLLM's %r endpoint hand-over)", count, path)
    start = _start_with_listeners if path == "listeners" else _start_with_addresses
    managers: list[Any] = []
    launched: Launched | None = None
    try:
        launched = start(config, Executor.get_class(config), count, target, make_spec, managers)
        yield launched
    finally:
        for manager in managers:  # the API processes' manager first: they drain, then the engine
            is_api = isinstance(manager, APIServerProcessManager)
            manager.shutdown(timeout=settings.shutdown_grace_s if is_api else None)
        if launched is not None:  # vLLM's listeners: their IPC paths go now, not at interpreter exit
            getattr(launched.endpoints, "cleanup", lambda: None)()
            launched.endpoints = None


def _start_with_listeners(
    config: Any, executor: Any, count: int, target: ApiTarget, make_spec: SpecMaker, managers: list[Any]
) -> Launched:
    from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
    from vllm.v1.utils import APIServerProcessManager

    listeners = bind_engine_zmq_listeners(config, count)
    try:
        with launch_core_engines(config, executor, False, listeners.addresses) as engine_launch:
            engine: Any = engine_launch.engine_manager  # local engines only: a CoreEngineProcManager
            managers.append(engine)
            api = APIServerProcessManager(
                "",  # each API process has its own socket, in the spec (listeners.py)
                None,
                make_spec([process.pid for process in engine.processes]),
                count,
                listeners.inputs,
                listeners.outputs,
                target_server_fn=target,
                tensor_queue=engine_launch.tensor_queue,
            )
            managers.insert(0, api)
            # The engine's start is abandoned if an API process dies before it is up.
            engine_launch.watched_frontend_processes = api.processes
    except BaseException:
        listeners.cleanup()  # the API processes' manager cleans them up once it exists
        raise
    return Launched("listeners", list(api.processes), list(engine.processes), listeners)


def _start_with_addresses(
    config: Any, executor: Any, count: int, target: ApiTarget, make_spec: SpecMaker, managers: list[Any]
) -> Launched:
    from vllm.v1.utils import APIServerProcessManager

    utils: Any = importlib.import_module("vllm.v1.engine.utils")  # 0.26's names, not this vLLM's
    addresses = utils.get_engine_zmq_addresses(config, count)
    launching = utils.launch_core_engines(config, executor, False, addresses, count)
    with launching as (engine, _coordinator, addresses, tensor_queue):
        managers.append(engine)
        api: Any = APIServerProcessManager(
            "",
            None,
            make_spec([process.pid for process in engine.processes]),
            count,
            addresses.inputs,
            addresses.outputs,
            target_server_fn=target,
            tensor_queue=tensor_queue,
        )
        managers.insert(0, api)
        # Each API process binds its endpoints and reports them; the engine's handshake (on
        # leaving this block) sends the bound ones to the engine core.
        addresses.inputs, addresses.outputs = api.gather_actual_addresses()
    return Launched("addresses", list(api.processes), list(engine.processes), addresses)
