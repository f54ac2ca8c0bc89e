"""HTTP routes of the Responses API: translate HTTP to `Responses` calls and back, nothing more."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shared.errors import EngineUnavailable, InvalidRequest
from shared.http.headers import parse_request_id
from shared.http.requests import SSE_HEADERS, EventStreamResponse, check_admission, read_json, service_of
from shared.responses.events import Event, ResponseFolder
from shared.responses.manager import Responses, sse_frame, translate
from shared.responses.request import parse_responses_request
from shared.settings import Settings

MAX_STARTING_AFTER_DIGITS = 18


def add_routes(app: FastAPI, settings: Settings) -> None:
    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        check_admission(request)
        body = parse_responses_request(await read_json(request, settings))
        key = _client_key(request)
        responses = _responses(request)
        created = await responses.create(body, key)
        headers = {"X-Request-Id": key} if key else {}
        response_id = created.record["id"]
        if created.reader is None:  # background, or a retry whose generation is no longer held
            if body.stream:
                return _event_stream(await responses.events(response_id, None), headers)
            if body.background and not created.retried:
                return JSONResponse(created.record["base"], headers=headers)
            return JSONResponse(await responses.current(response_id), headers=headers)
        if body.stream:
            return _event_stream(translate(created.reader, ResponseFolder(created.record["base"])), headers)
        folder = ResponseFolder(created.record["base"])
        async for _ in translate(created.reader, folder):
            pass  # the keeper, not the handler, stores the final object
        return JSONResponse(folder.response, headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        responses = _responses(request)
        if request.query_params.get("stream", "false").lower() != "true":
            return JSONResponse(await responses.current(response_id))
        starting_after = _starting_after(request.query_params.get("starting_after"))
        return _event_stream(await responses.events(response_id, starting_after), {})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> Response:
        return JSONResponse(await _responses(request).cancel(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Response:
        return JSONResponse(await _responses(request).delete(response_id))


def _responses(request: Request) -> Responses:
    service_of(request)  # 503 while the engine starts
    responses: Responses | None = getattr(request.app.state, "responses", None)
    if responses is None:
        raise EngineUnavailable("the engine is starting")
    return responses


def _client_key(request: Request) -> str | None:
    """X-Request-Id, else Idempotency-Key: either makes the create call idempotent."""
    key = parse_request_id(request.headers.get("x-request-id"))
    if key is None:
        key = parse_request_id(request.headers.get("idempotency-key"), param="Idempotency-Key")
    return key


def _starting_after(raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > MAX_STARTING_AFTER_DIGITS:
        raise InvalidRequest("starting_after must be a non-negative integer", param="starting_after")
    return int(raw)


def _event_stream(events: AsyncIterator[Event], headers: dict[str, str]) -> Response:
    return EventStreamResponse(_frames(events), headers={**SSE_HEADERS, **headers})


async def _frames(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield sse_frame(event)
    finally:
        aclose: Any = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
