"""The one place the Responses API calls the core's service: open (or follow) a generation, and
cancel one. Everything else in this package goes through these two functions, so when the
service's door changes (`Service.open` becoming the only one) only this file follows it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from shared.protocol import ChatCompletionRequest
from shared.service import Service


class Reader(Protocol):
    """What a response needs of a generation's reader (`Subscription` or `RemoteSubscription`)."""

    async def admitted(self) -> None: ...

    def events(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...


async def open_generation(
    service: Service, body: ChatCompletionRequest, key: str, *, follow_only: bool
) -> Reader:
    """The chat generation of the response `key`, read from its first event, on whichever
    replica runs it. `follow_only`: never start one (a retrieve must not run a body again)."""
    after = 0 if follow_only else None
    return await service.open_shared("chat", body, key, after, event_ids=False)


async def cancel_generation(service: Service, key: str) -> str:
    """Abort the generation of `key` on whichever replica runs it; its final status."""
    return (await service.cancel(key)).status
