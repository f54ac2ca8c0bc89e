"""Names of the identity store's keys and channels (shared/replicas/store.py), one deployment per
database: a second deployment uses another (redis://host/1).

  bundle:claim:{id}       JSON {fp, owner, stream, state, numbered, epoch}; SET NX makes the first
                          replica the owner; a takeover (shared/replicas/takeover.py) swaps the owner
                          and bumps the epoch; owner "" means handed off (anyone may take it over)
  bundle:events:{id}      a Stream; entry id "<seq>-0", field d = one SSE event's data, x = a text
                          piece of a non-streaming generation, b = a whole non-streaming answer or
                          the 4xx of a refused request ({status, body}); t = the token ids whose
                          text the entry carries (uint32 little-endian), k = how many ids logged
                          before it a takeover kept (the rest were generated again)
  bundle:recipe:{id}      JSON: what a takeover needs to continue the generation (prompt token ids,
                          sampling parameters, the chunks' id and creation time)
  bundle:refused:{id}     JSON {status, body, retry_after_s}: the answer of a request refused after
                          its claim (429 at the in-flight cap), for followers that came meanwhile
  bundle:follow:{id}      exists while a follower on some replica reads (refreshed, short expiry)
  bundle:replica:{rid}    a replica's heartbeat (refreshed, short expiry: shared/replicas/liveness.py)
  bundle:cancel:{rid}     pub/sub channel: ids the replica `rid` must abort
"""

from __future__ import annotations

PREFIX = "bundle:"


def claim_key(request_id: str) -> str:
    return f"{PREFIX}claim:{request_id}"


def events_key(request_id: str) -> str:
    return f"{PREFIX}events:{request_id}"


def refused_key(request_id: str) -> str:
    return f"{PREFIX}refused:{request_id}"


def follow_key(request_id: str) -> str:
    return f"{PREFIX}follow:{request_id}"


def recipe_key(request_id: str) -> str:
    return f"{PREFIX}recipe:{request_id}"


def replica_key(replica_id: str) -> str:
    return f"{PREFIX}replica:{replica_id}"


def cancel_channel(replica_id: str) -> str:
    return f"{PREFIX}cancel:{replica_id}"
