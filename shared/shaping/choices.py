"""The slow path of a generation's output: n choices, logprobs and tool calls.

Plain requests (one choice, no logprobs, no tools) never come here: `ChunkEncoder.text` encodes
them from byte templates. Everything else is shaped per choice into a dict, which is both the
streamed chunk's choice and what the non-streaming body is assembled from, so the two agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.engine.contract import EngineDelta, TokenLogprob, ToolCallShaper
from shared.streaming import ChunkEncoder, Kind


class ChoiceState:
    """One choice: what it streamed so far (for the whole body) and its tool-call shaper."""

    def __init__(self, kind: Kind, index: int, shaper: ToolCallShaper | None) -> None:
        self.kind = kind
        self.index = index
        self.shaper = shaper
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []  # merged: id, type, function {name, arguments}
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None

    def apply(self, delta: EngineDelta) -> dict[str, Any] | None:
        """Record a delta; return the chunk's choice dict (None: nothing to send yet)."""
        content: str | None = delta.text
        calls: list[dict[str, Any]] = []
        if self.shaper is not None:
            shaped = self.shaper.feed(delta.text, delta.token_ids)
            content, calls = shaped.content, shaped.calls
            if delta.finish_reason is not None:
                rest = self.shaper.finish()
                content = (content or "") + (rest.content or "") or None
                calls = calls + rest.calls
        if content:
            self.content.append(content)
        for call in calls:
            self._merge(call)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        finish = delta.finish_reason
        if finish == "stop" and self.calls:
            finish = "tool_calls"
        self.finish_reason = finish or self.finish_reason
        if not (content or calls or delta.logprobs or finish):
            return None
        return self._chunk_choice(content or "", calls, delta.logprobs, finish)

    def _merge(self, call: dict[str, Any]) -> None:
        if "id" in call:
            self.calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
        elif self.calls:
            self.calls[-1]["function"]["arguments"] += call["function"]["arguments"]

    def _chunk_choice(
        self,
        content: str,
        calls: list[dict[str, Any]],
        logprobs: tuple[TokenLogprob, ...] | None,
        finish: str | None,
    ) -> dict[str, Any]:
        if self.kind == "completion":
            return {
                "index": self.index,
                "text": content,
                "logprobs": completion_logprobs(logprobs, self._offset_before(content)) if logprobs else None,
                "finish_reason": finish,
            }
        delta: dict[str, Any] = {"content": content} if content or not calls else {}
        if calls:
            delta["tool_calls"] = calls
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs) if logprobs else None,
            "finish_reason": finish,
        }

    def _offset_before(self, content: str) -> int:
        return sum(len(piece) for piece in self.content) - len(content)

    def whole(self) -> dict[str, Any]:
        """This choice in the non-streaming body."""
        text = "".join(self.content)
        if self.kind == "completion":
            return {
                "index": self.index,
                "text": text,
                "logprobs": completion_logprobs(self.logprobs, 0) if self.logprobs else None,
                "finish_reason": self.finish_reason,
            }
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if self.calls else "")}
        if self.calls:
            message["tool_calls"] = self.calls
        return {
            "index": self.index,
            "message": message,
            "logprobs": chat_logprobs(self.logprobs) if self.logprobs else None,
            "finish_reason": self.finish_reason,
        }


class Choices:
    """All choices of one generation, on the slow path."""

    def __init__(
        self,
        kind: Kind,
        n: int,
        *,
        with_logprobs: bool,
        shaper_factory: Callable[[], ToolCallShaper | None] = lambda: None,
    ) -> None:
        self.states = [ChoiceState(kind, index, shaper_factory()) for index in range(n)]
        self.with_logprobs = with_logprobs

    def openings(self, encoder: ChunkEncoder) -> list[bytes]:
        return [chunk for index in range(len(self.states)) if (chunk := encoder.opening(index))]

    def apply(self, delta: EngineDelta) -> dict[str, Any] | None:
        choice = self.states[delta.index].apply(delta)
        if choice is not None and self.with_logprobs and choice["logprobs"] is None and delta.finish_reason:
            # A last chunk with no new token: an empty list, as OpenAI sends, rather than null.
            choice["logprobs"] = {"content": []} if "delta" in choice else None
        return choice

    def whole(self) -> list[dict[str, Any]]:
        return [state.whole() for state in self.states]


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: Any) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": entry.token,
                "logprob": entry.logprob,
                "bytes": _token_bytes(entry.token),
                "top_logprobs": [
                    {"token": token, "logprob": logprob, "bytes": _token_bytes(token)}
                    for token, logprob in entry.top
                ],
            }
            for entry in entries
        ]
    }


def completion_logprobs(entries: Any, offset: int) -> dict[str, Any]:
    """The legacy endpoint's columnar shape; offsets count characters from the choice's start."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [entry.token for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [dict(entry.top) for entry in entries],
        "text_offset": offsets,
    }
