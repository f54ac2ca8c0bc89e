"""The one place the Responses API calls the core's service: open (or follow) a generation, and
cancel one, through `Service.open` (the core's one door, across replicas with a shared store)."""

from __future__ import annotations

from shared.generation.subscription import Subscription
from shared.schemas import ChatCompletionRequest
from shared.service import Service


async def open_generation(
    service: Service, body: ChatCompletionRequest, key: str, *, follow_only: bool
) -> Subscription:
    """The chat generation of the response `key`, read from its first event, on whichever
    replica runs it. `follow_only`: never start one (a retrieve must not run a body again)."""
    after = 0 if follow_only else None
    return await service.open("chat", body, key, after, event_ids=False)


async def cancel_generation(service: Service, key: str) -> str:
    """Abort the generation of `key` on whichever replica runs it; its final status."""
    return (await service.cancel(key)).status
