"""The HTTP face: the FastAPI app, its limits and headers, the uvicorn process."""
