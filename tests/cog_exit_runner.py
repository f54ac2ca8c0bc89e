"""A Cog runner with no engine whose worker process can be made to exit on request.

tests/test_cog.py runs it under the real coglet to pin what coglet 0.23.1 does when its worker
exits: the fact behind the runner's choice not to exit after engine death (docs/cog.md).
The prediction that asks for the exit is answered first: the worker exits at coglet's next
health check (which the test asks for), not after a delay that a loaded host may outrun.
Until then its healthcheck passes, so any UNHEALTHY seen afterwards is coglet's own verdict.
"""

from __future__ import annotations

import os

from cog import BaseRunner


class Runner(BaseRunner):
    exit_code = -1

    def healthcheck(self) -> bool:
        if self.exit_code >= 0:
            os._exit(self.exit_code)  # what the bundle's HTTP server does after engine death, done by a worker
        return True

    def run(self, exit_code: int = -1) -> str:
        if exit_code >= 0:
            type(self).exit_code = exit_code
            return "exiting"
        return "ok"
