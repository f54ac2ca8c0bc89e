"""Request identity as the door sees it: `Identity`, and `LocalIdentity` for a process with no
shared store (BUNDLE_REDIS_URL unset); `Replicas` (replicated.py) is the other implementation."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from shared.errors import NotFound
from shared.generation.subscription import Subscription

if TYPE_CHECKING:
    from shared.generation.registry import CancelOutcome, Entry
    from shared.replicas.store import Claim
    from shared.replicas.takeover import Logged, Recipe

log = logging.getLogger(__name__)


OpenHere = Callable[[], Subscription]
# How a replica continues a generation it took over (the service's engine): the claim, now its
# own; what the log holds; when the loss was found (time.monotonic()).
Continuer = Callable[[str, "Claim", "Logged", float], Awaitable["Entry"]]


class Identity(Protocol):
    """Which generation a request id names, across whatever replicas share it."""

    async def open(
        self,
        request_id: str,
        fingerprint: str,
        stream: bool,
        last_event_id: int | None,
        here: OpenHere,
        *,
        numbered: bool,
    ) -> Subscription:
        """Follow the generation this id names; `here()` opens it on this replica (attach,
        resume, or start) when it is (or becomes) this replica's."""
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

    def continue_with(self, continuer: Continuer) -> None:
        """How this replica continues a generation it takes over (the service's engine)."""
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

    async def open(
        self,
        request_id: str,
        fingerprint: str,
        stream: bool,
        last_event_id: int | None,
        here: OpenHere,
        *,
        numbered: bool,
    ) -> Subscription:
        return here()  # no await before it: a lookup and a start cannot be split by another request

    def mirror(self, entry: Entry, kept: int | None = None) -> None:
        pass  # nobody elsewhere reads it

    def record(self, entry: Entry, recipe: Callable[[], Recipe]) -> None:
        pass  # nobody elsewhere could take it over

    def own(self, entry: Entry) -> None:
        pass

    def continue_with(self, continuer: Continuer) -> None:
        pass

    async def orphans(self, request_ids: list[str]) -> list[str]:
        return []  # this process is the only one: what it runs dies with it

    async def hand_off(self) -> None:
        pass

    async def cancel(self, request_id: str, wait_s: float) -> CancelOutcome:
        raise NotFound(f"no request with id {request_id!r} is held", param="request_id")

    async def aclose(self) -> None:
        pass
