"""A Cog runner with no engine whose worker process can be made to exit on request.

tests/test_cog.py runs it under the real coglet to pin what coglet 0.23.1 does when its worker
exits: the fact behind the runner's choice not to exit after engine death (docs/cog.md).
Its healthcheck always passes, so any UNHEALTHY seen afterwards is coglet's own verdict.
"""

from __future__ import annotations

import os
import threading
import time

from cog import BaseRunner

EXIT_DELAY_S = 0.3  # the prediction that asked for the exit is answered first


def _exit_soon(code: int) -> None:
    time.sleep(EXIT_DELAY_S)
    os._exit(code)  # what the bundle's HTTP server does after engine death, done by a worker


class Runner(BaseRunner):
    def healthcheck(self) -> bool:
        return True

    def run(self, exit_code: int = -1) -> str:
        if exit_code >= 0:
            threading.Thread(target=_exit_soon, args=(exit_code,), daemon=True).start()
            return "exiting"
        return "ok"
