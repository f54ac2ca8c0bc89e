"""Engine deltas -> OpenAI chunk JSON -> SSE bytes.

Chunks are built from byte templates made once per generation: per token we only encode the
new text. This is the hot path of the server (one call per token per generation), so it stays
free of dicts and model objects. Requests that ask for more (n > 1, logprobs, tools) take the
slower `choice_chunk` path, built by `shared.shaping.choices` from a dict per choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from shared.errors import BundleError

Kind = Literal["chat", "completion"]
DONE_DATA = b"[DONE]"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": total,
        }


def sse_event(sequence: int, data: bytes) -> bytes:
    """One numbered SSE event; the id is what a client sends back as Last-Event-ID to resume."""
    return b"id: %d\ndata: %s\n\n" % (sequence, data)


def sse_data(data: bytes) -> bytes:
    """One SSE event without an id: the framing of a stream that cannot be resumed. It is also
    OpenAI's own framing, the only one that clients reading one `data:` line per event (vLLM's
    `bench serve`) understand."""
    return b"data: %s\n\n" % data


def error_data(error: BundleError) -> bytes:
    return orjson.dumps(error.to_openai())


def error_frames(error: BundleError) -> bytes:
    """An error event and the end marker, without ids: for a reader that cannot be served the
    numbered events any more (it fell behind the buffer), so nothing here may be resumed."""
    return sse_data(error_data(error)) + sse_data(DONE_DATA)


class ChunkEncoder:
    """Encodes one generation's chunks in OpenAI's streaming format (chat or legacy completion)."""

    def __init__(self, kind: Kind, completion_id: str, model: str, created: int | None = None) -> None:
        self.kind = kind
        self.completion_id = completion_id
        self.model = model
        # Given: a generation continued on another replica (a takeover) keeps its first chunks' time.
        self.created = int(time.time()) if created is None else created
        head = b'{"id":%s,"object":%s,"created":%d,"model":%s,' % (
            orjson.dumps(completion_id),
            b'"chat.completion.chunk"' if kind == "chat" else b'"text_completion"',
            self.created,
            orjson.dumps(model),
        )
        self._head = head
        if kind == "chat":
            self._text_prefix = head + b'"choices":[{"index":0,"delta":{"content":'
            self._text_suffix = b'},"logprobs":null,"finish_reason":%s}]}'
        else:
            self._text_prefix = head + b'"choices":[{"index":0,"text":'
            self._text_suffix = b',"logprobs":null,"finish_reason":%s}]}'

    def opening(self, index: int = 0) -> bytes | None:
        """Chat streams start with the assistant role (one chunk per choice), as OpenAI's do."""
        if self.kind != "chat":
            return None
        return self._head + (
            b'"choices":[{"index":%d,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}' % index
        )

    def choice_chunk(self, choice: dict[str, Any]) -> bytes:
        """A chunk carrying one choice's delta (the slow path: n > 1, logprobs, tool calls)."""
        return self._head + b'"choices":[' + orjson.dumps(choice) + b"]}"

    def text(self, text: str, finish_reason: str | None) -> bytes:
        reason = b"null" if finish_reason is None else b'"%s"' % finish_reason.encode()
        return self._text_prefix + orjson.dumps(text) + self._text_suffix % reason

    def usage(self, usage: Usage) -> bytes:
        """The extra last chunk of `stream_options.include_usage`: no choices, only usage."""
        return self._head + b'"choices":[],"usage":' + orjson.dumps(usage.as_dict()) + b"}"

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        """The whole non-streaming response body (one plain choice)."""
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self.response_of([choice], usage)

    def response_of(self, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage.as_dict(),
        }
