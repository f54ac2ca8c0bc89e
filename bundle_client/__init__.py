"""A client for the bundle's API that resumes streams (`bundle_client.client`).

It needs httpx and orjson only: none of the server's dependencies (vLLM, FastAPI, uvicorn, redis)."""
