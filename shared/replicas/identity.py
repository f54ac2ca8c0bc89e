"""Request identity as the door sees it: `Identity`, and `LocalIdentity` for a process with no
shared store (BUNDLE_REDIS_URL unset); `Replicas` (replicated.py) is the other implementation.

The door asks where the generation an id names is read (`place`); the answer is a `Placement`:
followed from elsewhere (another replica's, or one just taken over here), or to be opened by the
door on this replica, inside the placement's block, with nothing awaited between the lookup and
the start (so two requests with one id can never start two generations).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from shared.errors import NotFound
from shared.generation.subscription import Subscription

if TYPE_CHECKING:
    from shared.generation.registry import CancelOutcome, Entry
    from shared.replicas.takeover import Recipe


def _as_is(subscription: Subscription) -> Subscription:
    return subscription


@dataclass(frozen=True)
class Placement:
    """Where a request's generation is read. `elsewhere`: a reader the identity layer opened
    (the door returns it). None: the door opens the generation here and passes its reader
    through `here` (which lets the identity layer follow it across a takeover)."""

    elsewhere: Subscription | None = None
    here: Callable[[Subscription], Subscription] = field(default=_as_is)


class Identity(Protocol):
    """Which generation a request id names, across whatever replicas share it."""

    def place(
        self, request_id: str, fingerprint: str, stream: bool, last_event_id: int | None, *, numbered: bool
    ) -> AbstractAsyncContextManager[Placement]:
        """Where the generation this id names is read. A door that opens it here does so inside
        the block; an exception from the block undoes what placing did (a claim is released)."""
        ...

    def mirror(self, entry: Entry, kept: int | None = None) -> None:
        """Before a generation with an id starts here: put what others must read behind it.
        `kept`: a takeover's, the count of token ids logged before it that it continues from."""
        ...

    def record(self, entry: Entry, recipe: Callable[[], Recipe]) -> None:
        """Once its prompt is rendered: what another replica needs to take it over (built only
        where a takeover can happen)."""
        ...

    def own(self, entry: Entry) -> None:
        """Once it started: record its end where others can read it."""
        ...

    async def orphans(self, request_ids: list[str]) -> list[str]:
        """Those ids whose generation runs with nobody left to run it (a takeover would go on)."""
        ...

    async def hand_off(self) -> None:
        """Shutting down: hand what runs here over to other replicas, where they can continue it."""
        ...

    async def cancel(self, request_id: str, wait_s: float) -> CancelOutcome:
        """Cancel an id this replica does not hold; `NotFound` when nobody holds it."""
        ...

    async def aclose(self) -> None: ...


class LocalIdentity:
    """Identity within this process: the registry is all there is."""

    @asynccontextmanager
    async def place(
        self, request_id: str, fingerprint: str, stream: bool, last_event_id: int | None, *, numbered: bool
    ) -> AsyncIterator[Placement]:
        yield Placement()  # always here; nothing awaited before the door's lookup and start

    def mirror(self, entry: Entry, kept: int | None = None) -> None:
        pass  # nobody elsewhere reads it

    def record(self, entry: Entry, recipe: Callable[[], Recipe]) -> None:
        pass  # nobody elsewhere could take it over

    def own(self, entry: Entry) -> None:
        pass

    async def orphans(self, request_ids: list[str]) -> list[str]:
        return []  # this process is the only one: what it runs dies with it

    async def hand_off(self) -> None:
        pass

    async def cancel(self, request_id: str, wait_s: float) -> CancelOutcome:
        raise NotFound(f"no request with id {request_id!r} is held", param="request_id")

    async def aclose(self) -> None:
        pass
