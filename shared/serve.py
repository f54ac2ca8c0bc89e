"""`python -m shared.serve`: run the API with uvicorn. Flags override BUNDLE_* settings."""

from __future__ import annotations

import argparse
import logging

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
    import uvicorn

    from shared.api import create_app

    # The bundle's own start-up lines (engine, request identity) next to uvicorn's.
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("shared").setLevel(settings.log_level.upper())
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # The API is one process driving one in-process engine; keep-alive helps SSE clients.
        timeout_keep_alive=30,
    )


if __name__ == "__main__":
    main()
