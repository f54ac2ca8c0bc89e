"""What a reader of one generation holds, whichever door it came through: this replica's
registry (`LocalSubscription`) or the shared store (`RemoteSubscription`) serve it the same way."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from shared.generation.replay import EventsPerWrite, WriteNow
from shared.streaming import Usage


class Subscription(Protocol):
    """One reader of one generation. Close it exactly when the reader is gone (idempotent)."""

    @property
    def request_id(self) -> str | None: ...

    @property
    def stream(self) -> bool: ...

    @property
    def usage(self) -> Usage:
        """Prompt and generated token counts so far (final once the text has ended)."""
        ...

    async def admitted(self) -> None:
        """Return once the request may reach the engine; raise its 4xx otherwise (before any 200)."""
        ...

    def events(
        self,
        coalesce_s: float = 0.0,
        events_per_write: EventsPerWrite | None = None,
        write_now: WriteNow | None = None,
    ) -> AsyncIterator[bytes]:
        """SSE bytes after the resume point until [DONE] (a streaming request); those that
        `write_now` (the connection's direct write, where the server has one) took are not
        yielded."""
        ...

    def text(self) -> AsyncIterator[str]:
        """The generated text from the start, in pieces as it grows (the Cog runner's view)."""
        ...

    async def response(self) -> dict[str, Any]:
        """The whole non-streaming body (raises the generation's error)."""
        ...

    def close(self) -> None: ...

    def abandon(self) -> None:
        """The reader stops early and will not come back: close, and abort if it was the last."""
        ...
