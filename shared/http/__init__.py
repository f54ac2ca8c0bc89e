"""The HTTP face: the FastAPI app, its limits and headers, the uvicorn process, and what it uses of
uvicorn's and Starlette's internals (server_internals, checked at start)."""
