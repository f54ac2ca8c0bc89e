"""What a takeover needs, read from the shared log: the recipe a generation was started with, what
it sent so far (events, text, the token ids of that text), and the plan to continue it.

A replica that takes over a generation whose producer is gone (shared/replicas/replicated.py) sends
its own engine the original prompt followed by the token ids already sent, with the same sampling
parameters and `max_tokens` reduced by them, and appends what comes to the same log under the
next event ids. Token ids, not text: text tokenized again could merge differently at the seam.

The seam must also be exact in text. vLLM holds text back while it may be the start of a stop
string, and a token that ends inside a multi-byte character has no text of its own yet, so the
ids logged can run ahead of the text sent. The plan keeps the longest run of ids whose text
(decoded as vLLM's incremental detokenizer does, after the prompt) is a prefix of the text sent;
the continuation then generates the rest of the sent text again, and it is checked against what
was sent before anything new goes out (`after_sent`): a continuation that does not reproduce it
(sampling) ends with `producer_lost` rather than splice two texts.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any

import orjson

from shared.engine.contract import SamplingRequest
from shared.errors import ProducerLost
from shared.replicas.store import BODY, DATA, KEPT, TEXT, TOKENS
from shared.replicas.tokens import unpack_ids
from shared.streaming import DONE_DATA

if TYPE_CHECKING:
    from shared.engine.contract import EngineDelta

# What a decoder gives for each id: its new text, or None while it ends inside a character.
DecodeSteps = Sequence[str | None]
CANCELLED_CODE = "request_cancelled"


@dataclass(frozen=True)
class Recipe:
    """How a generation was started: enough to continue it on any replica."""

    kind: str  # "chat" or "completion"
    completion_id: str  # the chunks' id ...
    created: int  # ... and creation time, so the continuation's chunks match the first ones
    model: str  # the base's name or an adapter's (the adapter is looked up by it)
    stream: bool
    include_usage: bool
    prompt: list[int]  # the rendered prompt's token ids
    sampling: dict[str, Any]  # SamplingRequest's plain fields (no prompt, adapter, constraint)
    refusal: str | None = None  # why it cannot be continued exactly; None: it can

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Recipe:
        return cls(**orjson.loads(raw))


# A SamplingRequest's fields the log leaves out: the prompt is the recipe's own; a constraint
# never continues (`refusal_of`); the pacing, the adapter and the trace context are the continuing
# replica's (its spans belong to the request that took it over).
NOT_LOGGED = frozenset({"prompt_token_ids", "constraint", "stream_interval", "adapter", "trace_headers"})
LOGGED_FIELDS = tuple(f.name for f in dataclass_fields(SamplingRequest) if f.name not in NOT_LOGGED)


def sampling_of(request: SamplingRequest) -> dict[str, Any]:
    """The logged fields of `request` as JSON-ready values (`sampling_from` reverses it)."""
    plain = {name: getattr(request, name) for name in LOGGED_FIELDS}
    plain["stop"] = list(request.stop)
    plain["stop_token_ids"] = list(request.stop_token_ids)
    plain["logit_bias"] = [[token, bias] for token, bias in request.logit_bias.items()]
    return plain


def sampling_from(recipe: Recipe) -> SamplingRequest:
    """The request a generation was started with, as its log holds it (no constraint, adapter
    or pacing: see NOT_LOGGED)."""
    given = dict(recipe.sampling)
    given["stop"] = tuple(given["stop"])
    given["stop_token_ids"] = tuple(given["stop_token_ids"])
    given["logit_bias"] = {int(token): float(bias) for token, bias in given["logit_bias"]}
    return SamplingRequest(prompt_token_ids=list(recipe.prompt), **given)


def refusal_of(request: SamplingRequest, shaped: bool) -> str | None:
    """Why a generation could not be continued exactly, in the words its error gives (None: it
    can). vLLM cannot start a grammar part-way through its output, a continuation cannot draw
    the other choices of n > 1 or give back logprobs already sent, and tool-call parsing keeps
    state the log does not hold."""
    if request.constraint is not None:
        return "structured output (its grammar cannot be resumed part-way)"
    if request.n > 1:
        return "n > 1"
    if request.logprobs is not None:
        return "logprobs"
    if shaped:
        return "tool calls"
    return None


@dataclass
class Logged:
    """What the log of a generation holds, read from its first entry."""

    recipe: Recipe | None
    events: list[bytes] = field(default_factory=list)  # the data of each streamed event, in order
    last: int = 0  # sequence number of the last entry
    text: str = ""  # the text sent so far (the first choice's)
    ids: list[int] = field(default_factory=list)  # the token ids of that text
    finish_reason: str | None = None  # a chunk with it was sent: no token comes after it
    usage_sent: bool = False
    end: str | None = None  # the generation ended: "completed", "failed" or "cancelled"
    closed: bool = False  # and its log is whole ([DONE], or a whole answer, is in it)
    gap: bool = False  # an entry is missing (trimmed, or dropped in a store outage)


def read_log(entries: list[tuple[int, dict[bytes, bytes]]], recipe: bytes | None) -> Logged:
    logged = Logged(Recipe.decode(recipe) if recipe is not None else None)
    for sequence, fields in entries:
        logged.gap = logged.gap or sequence != logged.last + 1
        logged.last = sequence
        if KEPT in fields:
            del logged.ids[int(fields[KEPT]) :]
        if TOKENS in fields:
            logged.ids += unpack_ids(fields[TOKENS])
        if TEXT in fields:
            logged.text += fields[TEXT].decode()
        if DATA in fields:
            _read_event(logged, fields[DATA])
        if BODY in fields:
            logged.end = "completed" if orjson.loads(fields[BODY])["status"] == 200 else "failed"
            logged.closed = True
    return logged


def _read_event(logged: Logged, data: bytes) -> None:
    logged.events.append(data)
    if data == DONE_DATA:
        logged.end = logged.end or "completed"
        logged.closed = True
        return
    chunk = orjson.loads(data)
    if "error" in chunk:
        code = (chunk["error"] or {}).get("code")
        logged.end = "cancelled" if code == CANCELLED_CODE else "failed"
        return
    logged.usage_sent = logged.usage_sent or bool(chunk.get("usage"))
    for choice in chunk.get("choices") or ():
        if choice.get("index", 0) != 0:
            continue
        logged.text += _choice_text(choice)
        logged.finish_reason = choice.get("finish_reason") or logged.finish_reason


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice["text"] or "")
    return str((choice.get("delta") or {}).get("content") or "")


@dataclass(frozen=True)
class Plan:
    """How to go on: `kept` logged ids end the new prompt; `resent` is text already sent that the
    continuation generates again first (checked, not sent twice); `refusal`: it cannot go on."""

    kept: int = 0
    resent: str = ""
    remaining: int = 0  # max_tokens left
    refusal: str | None = None


def plan(logged: Logged, steps: DecodeSteps | None) -> Plan:
    """`steps`: the incremental text of each logged id after the prompt (None: this engine cannot
    decode that way, so every id is generated again and checked)."""
    recipe = logged.recipe
    if recipe is None:
        return Plan(refusal="its log holds no recipe (started without takeover, or lost by the store)")
    if logged.gap:
        return Plan(refusal="its log has a gap (trimmed by BUNDLE_MAX_EVENTS_PER_REQUEST, or a store outage)")
    if recipe.refusal is not None:
        return Plan(refusal=recipe.refusal)
    kept, text = _longest_sent_prefix(logged.text, steps) if steps is not None else (0, "")
    return Plan(kept=kept, resent=logged.text[len(text) :], remaining=int(recipe.sampling["max_tokens"]) - kept)


def _longest_sent_prefix(sent: str, steps: DecodeSteps) -> tuple[int, str]:
    """The most ids whose text is all out and a prefix of `sent` (an id whose character is not
    whole yet cannot end a prompt: its text would be lost at the seam)."""
    best = (0, "")
    text = ""
    for index, piece in enumerate(steps):
        if piece is None:
            continue
        text += piece
        if not sent.startswith(text):
            break
        best = (index + 1, text)
    return best


def continuation_seed(recipe: Recipe, request_id: str, kept: int) -> int | None:
    """The seed of a sampled continuation: derived from the request's own (or its id), and from
    where it starts, so a takeover tried again from the same point draws the same tokens."""
    if float(recipe.sampling["temperature"]) == 0.0:
        return recipe.sampling["seed"]  # type: ignore[no-any-return]
    base = recipe.sampling["seed"] if recipe.sampling["seed"] is not None else request_id
    digest = hashlib.sha256(f"bundle-takeover\0{base}\0{kept}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


async def after_sent(deltas: AsyncIterator[EngineDelta], sent: str) -> AsyncIterator[EngineDelta]:
    """The deltas of a continuation less the text already sent (`Plan.resent`), which must come
    first, exactly; anything else ends it with `producer_lost` instead of a spliced text."""
    pending = sent
    async for delta in deltas:
        if pending:
            common = min(len(delta.text), len(pending))
            if delta.text[:common] != pending[:common] or (delta.finish_reason and common < len(pending)):
                raise ProducerLost(
                    "the generation's replica stopped, and its continuation elsewhere did not "
                    "reproduce the text already sent; start again with a new X-Request-Id"
                )
            pending = pending[common:]
            delta.text = delta.text[common:]
        yield delta
