"""`python -m shared.serve`: run the API with uvicorn. Flags override BUNDLE_* settings."""

from __future__ import annotations

import argparse

from shared.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m shared.serve",
        description="Serve the OpenAI-compatible API on vLLM. Every BUNDLE_* variable applies.",
    )
    parser.add_argument("--host", help="bind address (BUNDLE_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (BUNDLE_PORT, default 8000)")
    parser.add_argument("--model", help="'tiny', a Hugging Face id or a path (BUNDLE_MODEL)")
    args = parser.parse_args(argv)
    overrides = {key: value for key, value in vars(args).items() if value is not None}
    settings = Settings(**overrides)
    serve(settings)


def serve(settings: Settings) -> None:
    from shared.process import run_server

    # Non-zero only when the engine died: a supervisor must then replace this process.
    exit_code = run_server(settings)
    if exit_code:
        raise SystemExit(exit_code)


if __name__ == "__main__":
    main()
