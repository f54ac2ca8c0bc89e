"""A small Server-Sent Events parser (the WHATWG event-stream format), for the client side."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str | None = None


async def parse_events(lines: AsyncIterator[str]) -> AsyncIterator[ServerSentEvent]:
    """Turn an async iterator of text lines (without line endings) into events."""
    data: list[str] = []
    event = ""
    event_id: str | None = None
    async for line in lines:
        if not line:
            if data or event:
                yield ServerSentEvent("\n".join(data), event or "message", event_id)
            data, event, event_id = [], "", None
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field == "id":
            event_id = value
    if data:
        yield ServerSentEvent("\n".join(data), event or "message", event_id)
