"""Responses on top of the core's generations: create, follow, fold, cancel, delete.

A response is one chat generation whose identity key is the response id, so everything the core
gives a generation (one per id, a replay log any replica follows, cancel from any replica, the
end of a dead replica's stream reported as `producer_lost`) holds for responses too.

Background mode needs no change to the core: the replica that creates a background response
keeps a reader of its own on the generation (the keeper) until it ends, so the generation never
looks abandoned when the client leaves, and the keeper stores the final object.

When that replica is lost (with a shared store and takeover), another continues the generation
(shared/replicas/replicated.py) and keeps it from then on: a replica that finds it runs a stored
response's generation keeps it. Nobody need come back for a background response: every replica
looks for those whose replica is gone (`_adopt_orphans`, every ADOPT_EVERY_S) and opens them,
which takes them over.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from shared.errors import BundleError, EventsGone, IdempotencyConflict, InvalidRequest, NotFound
from shared.generation.subscription import Subscription
from shared.responses.door import cancel_generation, open_generation
from shared.responses.events import Event, ResponseFolder, base_object, rebuilt_events
from shared.responses.records import Record, ResponseStore, not_found, open_store
from shared.responses.request import (
    ResponsesRequest,
    chat_body,
    input_messages,
    output_messages,
    parse_responses_request,
)
from shared.service import Service

log = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "failed", "cancelled", "incomplete"})
ID_BYTES = 24  # 192 random bits: response ids cannot be guessed
# A GET of a running response folds the log as it is now: it stops once no event came for this
# long (the events already written arrive in one read, so this is only the tail's wait).
FOLD_IDLE_S = 0.2
FOLD_BOUND_S = 5.0  # and never reads longer than this
# How often each replica looks for background responses whose replica was lost, and how many it
# checks at once (one MGET and one pipeline for all of them): a takeover follows within about the
# heartbeat's lapse (3 s) plus this.
ADOPT_EVERY_S = 1.0
ADOPT_BATCH = 256


def response_id_for(client_key: str | None, secret: bytes = b"") -> str:
    """A new random id, or, for a client's X-Request-Id / Idempotency-Key, the one id derived from
    it (so a retry on any replica names the same response). Keyed with `secret` (the deploy's
    API key, which every replica shares): a key seen in a proxy's log is not enough to compute
    the id and read, cancel or delete the response. Without an API key the server is open to
    everyone anyway, and the id is the key's plain hash."""
    if client_key is None:
        return "resp_" + secrets.token_hex(ID_BYTES)
    digest = hmac.new(secret, b"bundle-responses\0" + client_key.encode(), hashlib.sha256).hexdigest()
    return "resp_" + digest[: 2 * ID_BYTES]


@dataclass
class Created:
    record: Record
    # The handler's reader of the generation from its first event; None where the handler reads
    # through `events`/`current` instead (background, or a retry whose generation is gone).
    reader: Subscription | None
    retried: bool = False  # the key named a response already stored


class Responses:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.settings = service.settings
        self.store: ResponseStore = open_store(service.settings)
        api_key = service.settings.api_key
        self._id_secret = api_key.get_secret_value().encode() if api_key is not None else b""
        self._keepers: set[asyncio.Task[None]] = set()
        self._kept: set[str] = set()  # ids of the responses kept on this replica now
        self._adopter: asyncio.Task[None] | None = None
        if self.settings.redis_url is not None and self.settings.takeover:  # replicas to adopt from
            self._adopter = asyncio.get_running_loop().create_task(self._adopt_orphans())

    async def aclose(self) -> None:
        tasks = [*self._keepers, *([self._adopter] if self._adopter else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.store.aclose()

    # --- create ----------------------------------------------------------------------------------
    async def create(self, request: ResponsesRequest, client_key: str | None) -> Created:
        """Start the response's generation (or attach to the one its key already names) and
        store its record; raises the 4xx of bad input before anything is sent."""
        response_id = response_id_for(client_key, self._id_secret)
        if client_key is not None and request.store:
            stored = await self.store.get(response_id)
            if stored is not None:
                return await self._retried(stored, request)
        history = await self._history(request.previous_response_id)
        reader = await open_generation(
            self.service, chat_body(request, history), response_id, follow_only=False
        )
        try:
            await reader.admitted()
            record = await self.store.get(response_id) if request.store else None
            if record is None:
                record = _new_record(response_id, request, history)
                if request.store:
                    await self.store.put(response_id, record)
                    if request.background:
                        await self.store.mark_running(response_id)
        except BaseException:
            reader.close()
            raise
        if not request.store:
            return Created(record, reader)
        # Every stored response is kept to its end here and its final object saved, whoever
        # reads it: a client that leaves must not leave it `in_progress` for ever.
        self._keep(reader, record)
        if request.background:
            return Created(record, None)
        return Created(record, await self._reader_of(record))

    async def _retried(self, stored: Record, request: ResponsesRequest) -> Created:
        """A create whose key names a stored response. The core forgets a generation after
        `retention_s`, long before the record expires, so this never starts one: a second run
        under the same id would answer a retry with another text."""
        if stored["request"] != _request_json(request):
            raise IdempotencyConflict(
                "this X-Request-Id / Idempotency-Key was already used with a different body",
                param="X-Request-Id",
            )
        if request.background or stored["response"]["status"] in TERMINAL:
            return Created(stored, None, retried=True)
        try:
            reader = await self._reader_of(stored)
        except (EventsGone, NotFound):  # no longer held: the handler answers the stored state
            return Created(stored, None, retried=True)
        return Created(stored, reader, retried=True)

    async def _history(self, previous_id: str | None) -> list[dict[str, Any]]:
        """The conversation `previous_response_id` continues: its input items and its output."""
        if previous_id is None:
            return []
        record = await self.store.get(previous_id)
        if record is None:
            error = not_found(previous_id, self.settings)
            error.param = "previous_response_id"
            raise error
        response = record["response"]
        if response["status"] not in TERMINAL:
            response = await self.current(previous_id)
        if response["status"] not in ("completed", "incomplete"):  # an incomplete one still has its text
            raise InvalidRequest(
                f"previous_response_id {previous_id!r} is {response['status']}; only a completed or "
                "incomplete response can be continued",
                param="previous_response_id",
            )
        previous = parse_responses_request(record["request"])
        return [*record["history"], *input_messages(previous), *output_messages(response["output"])]

    def _keep(self, reader: Subscription | None, record: Record) -> None:
        """Follow a stored response to its end on this replica and store the final object
        (`reader`: from its first event; None: open one)."""
        response_id = record["id"]

        async def keep() -> None:
            folder = ResponseFolder(record["base"])
            async for _ in translate(reader or await self._follow(record), folder):
                pass
            await self._save(record, folder.response)

        self._kept.add(response_id)  # before the task runs: one keeper per response here
        task = asyncio.get_running_loop().create_task(keep())
        self._keepers.add(task)
        task.add_done_callback(lambda done: self._kept_to_end(done, response_id))

    def _kept_to_end(self, task: asyncio.Task[None], response_id: str) -> None:
        self._keepers.discard(task)
        self._kept.discard(response_id)
        if not task.cancelled() and task.exception() is not None:
            log.error("a background response's keeper failed: %r", task.exception())

    def _keep_if_taken_over(self, record: Record) -> None:
        """This replica runs a stored response's generation it did not start (it took it over
        when the one that did was lost): keep it, as its creator would have."""
        response_id = record["id"]
        stored = record["request"].get("store", True) is not False
        if stored and response_id not in self._kept and self.service.runs_here(response_id):
            self._keep(None, record)

    async def _save(self, record: Record, response: dict[str, Any]) -> None:
        if record["request"].get("store", True) is False:
            return
        record = {**record, "response": response}
        with contextlib.suppress(BundleError):  # logged by the store's caller on the next read
            await self.store.update(record["id"], record)
            if response["status"] in TERMINAL and response.get("background"):
                await self.store.forget_running(record["id"])

    # --- adoption: background responses whose replica was lost -------------------------------------
    async def _adopt_orphans(self) -> None:
        while True:
            await asyncio.sleep(ADOPT_EVERY_S)
            try:
                await self._adopt_once()
            except BundleError as error:  # the store is down: the next round tries again
                log.debug("adopting background responses: %s", error.message)
            except Exception:  # a dead loop would leave every later orphan unadopted
                log.exception("adopting background responses failed unexpectedly; trying again")

    async def _adopt_once(self) -> None:
        listed = await self.store.running(ADOPT_BATCH)
        for response_id in await self.service.orphans(listed):
            record = await self.store.get(response_id)
            if record is None or record["response"]["status"] in TERMINAL:
                await self.store.forget_running(response_id)
                continue
            try:
                (await self._follow(record)).close()  # opening it takes it over; a keeper starts
            except EventsGone:  # nothing left to continue: its stored state says so from now on
                await self.current(response_id)
            log.info("adopted background response %s", response_id)

    # --- read ------------------------------------------------------------------------------------
    async def record(self, response_id: str) -> Record:
        record = await self.store.get(response_id)
        if record is None:
            raise not_found(response_id, self.settings)
        return record

    async def current(self, response_id: str) -> dict[str, Any]:
        """The Response object as it is now: stored when final, else folded from its log."""
        record = await self.record(response_id)
        if record["response"]["status"] in TERMINAL:
            return dict(record["response"])
        folder = ResponseFolder(record["base"])
        try:
            reader = await self._follow(record)
        except EventsGone as error:  # the replica running it died, or nothing of it is held any more
            folder.start()
            folder.fail(error.code or "events_gone", error.message)
        else:
            await _fold_for_now(translate(reader, folder))
        if folder.status in TERMINAL:
            await self._save(record, folder.response)
        return folder.response

    async def events(self, response_id: str, starting_after: int | None) -> AsyncIterator[Event]:
        """The response's events after `starting_after` (all when None), live until its end."""
        record = await self.record(response_id)
        folder = ResponseFolder(record["base"])
        after = -1 if starting_after is None else starting_after
        try:
            reader = await self._follow(record)
        except EventsGone as error:
            final = record["response"]["status"] in TERMINAL  # its log expired, not its object
            source = _listed(rebuilt_events(record["response"])) if final else _failed_source(folder, error)
        else:
            await _admitted(reader)
            source = translate(reader, folder)
        return _after(source, after)

    async def _reader_of(self, record: Record) -> Subscription:
        reader = await self._follow(record)
        await _admitted(reader)
        return reader

    async def _follow(self, record: Record) -> Subscription:
        """A reader of the response's generation from its first event, on whichever replica runs
        it (taking it over if its replica was lost)."""
        request = parse_responses_request(record["request"])
        body = chat_body(request, record["history"])
        reader = await open_generation(self.service, body, record["id"], follow_only=True)
        self._keep_if_taken_over(record)
        return reader

    # --- cancel and delete -----------------------------------------------------------------------
    async def cancel(self, response_id: str) -> dict[str, Any]:
        record = await self.record(response_id)
        if not record["response"].get("background"):
            raise InvalidRequest("only background responses can be cancelled", param="response_id")
        if record["response"]["status"] not in TERMINAL:
            with contextlib.suppress(NotFound):  # it ended (and was let go) meanwhile
                await cancel_generation(self.service, response_id)
        return await self.current(response_id)

    async def delete(self, response_id: str) -> dict[str, Any]:
        record = await self.record(response_id)
        if record["response"]["status"] not in TERMINAL:
            with contextlib.suppress(NotFound):
                await cancel_generation(self.service, response_id)
        await self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _new_record(response_id: str, request: ResponsesRequest, history: list[dict[str, Any]]) -> Record:
    base = base_object(response_id, request, int(time.time()))
    return {
        "id": response_id,
        "request": _request_json(request),
        "history": history,
        # Every reader folds the log from this same start (`response` is the object as last known).
        "base": base,
        "response": base,
    }


def _request_json(request: ResponsesRequest) -> dict[str, Any]:
    return request.model_dump(mode="json", by_alias=True, exclude_unset=True)


async def _admitted(reader: Subscription) -> None:
    """Wait for the reader's admission; close it if that fails (nothing else would)."""
    try:
        await reader.admitted()
    except BaseException:
        reader.close()
        raise


async def translate(reader: Subscription, folder: ResponseFolder) -> AsyncGenerator[Event, None]:
    """The Responses events of a generation's chat stream, from its first event to its end."""
    try:  # from the first event: a reader left at `response.created` is closed all the same
        for event in folder.start():
            yield event
        async for chunk in reader.events():
            for data in sse_payloads(chunk):
                events = folder.on_done() if data == b"[DONE]" else folder.on_chunk(orjson.loads(data))
                for event in events:
                    yield event
    finally:
        reader.close()
    if not folder.ended:  # never without a terminal event: the SDK's stream helper needs one
        for event in folder.fail("stream_ended", "the generation's events ended without an end"):
            yield event


async def _listed(events: list[Event]) -> AsyncGenerator[Event, None]:
    for event in events:
        yield event


async def _failed_source(folder: ResponseFolder, error: BundleError) -> AsyncGenerator[Event, None]:
    for event in [*folder.start(), *folder.fail(error.code or "events_gone", error.message)]:
        yield event


async def _after(source: AsyncGenerator[Event, None], after: int) -> AsyncIterator[Event]:
    async with contextlib.aclosing(source):  # closing this closes the source (and its reader)
        async for event in source:
            if event["sequence_number"] > after:
                yield event


def sse_payloads(chunk: bytes) -> list[bytes]:
    """The `data:` payloads of one or more SSE frames (a reader may get a backlog in one piece)."""
    payloads = []
    for frame in chunk.split(b"\n\n"):
        for line in frame.split(b"\n"):
            if line.startswith(b"data: "):
                payloads.append(line[6:])
    return payloads


async def _fold_for_now(events: AsyncIterator[Event]) -> None:
    """Read what the log holds now: stop after FOLD_IDLE_S without a new event (or at the end)."""
    iterator = aiter(events)
    deadline = time.monotonic() + FOLD_BOUND_S
    try:
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(anext(iterator), FOLD_IDLE_S)
            except (StopAsyncIteration, TimeoutError):
                return
    finally:
        with contextlib.suppress(Exception):
            await iterator.aclose()  # type: ignore[attr-defined]


def sse_frame(event: Event) -> bytes:
    """One Responses event on the wire; its SSE id is its sequence number."""
    return b"event: %s\nid: %d\ndata: %s\n\n" % (
        event["type"].encode(),
        event["sequence_number"],
        orjson.dumps(event),
    )
