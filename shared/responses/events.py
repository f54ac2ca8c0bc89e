"""Chat chunks -> Responses events, and the Response object they fold into.

A response's generation writes ordinary chat chunks into the replay log (shared/generation/replay.py, or
the shared store). Every reader, on any replica, runs this translation over the log from its
first event, so the Responses events (and their `sequence_number`s) are the same for everyone:
the translation depends only on the chunks and on the stored request, never on who reads or
when. `starting_after=N` is then "translate from the start, send what comes after N".
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from shared.responses.request import ResponsesRequest

Event = dict[str, Any]
# Error codes of the chat stream's error event that mean "stopped on purpose".
CANCELLED_CODES = frozenset({"request_cancelled"})


def base_object(response_id: str, request: ResponsesRequest, created_at: int) -> dict[str, Any]:
    """The Response object before any output: the request's settings echoed back."""
    fmt = request.text.format if request.text and request.text.format else None
    tool_choice: Any = request.tool_choice or "auto"
    if not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "queued" if request.background else "in_progress",
        "background": request.background,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "temperature": request.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": request.user,
    }


class ResponseFolder:
    """Folds one generation's chat chunks into Responses events and the Response object."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.response = copy.deepcopy(base)
        # Item ids come from their own hash of the response id: an item id shown to someone
        # must not give away most of the response id (the key to read or cancel it).
        self._suffix = hashlib.sha256(b"bundle-response-items\0" + base["id"].encode()).hexdigest()[:40]
        self._sequence = -1
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # open function_call items by chat tool index
        self._finish_reason: str | None = None
        self.ended = False

    @property
    def status(self) -> str:
        return str(self.response["status"])

    def start(self) -> list[Event]:
        """The events before any chunk: created (queued or in_progress), then in_progress."""
        created = self._event("response.created", response=self._snapshot())
        self.response["status"] = "in_progress"
        return [created, self._event("response.in_progress", response=self._snapshot())]

    def on_chunk(self, chunk: dict[str, Any]) -> list[Event]:
        if self.ended:
            return []
        if "error" in chunk:
            return self._end_with_error(chunk["error"])
        if chunk.get("usage"):
            self._usage(chunk["usage"])
        events: list[Event] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call_delta(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return events

    def on_done(self) -> list[Event]:
        """The chat stream's [DONE]: close the open items and send the terminal event."""
        if self.ended:
            return []
        events = self._close_items()
        self.ended = True
        if self._finish_reason == "length":
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self._snapshot())]
        self.response["status"] = "completed"
        return [*events, self._event("response.completed", response=self._snapshot())]

    def fail(self, code: str, message: str) -> list[Event]:
        """End without a chat error event (the log could not be read to its end)."""
        return self._end_with_error({"code": code, "message": message})

    # --- items -----------------------------------------------------------------------------------
    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._message is None:
            index = len(self.response["output"])
            item: dict[str, Any] = {
                "id": f"msg_{index}_{self._suffix}",
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.response["output"].append(item)
            self._message = item
            events.append(
                self._event("response.output_item.added", output_index=index, item=_without_content(item))
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            )
        item = self._message
        item["content"][0]["text"] += text
        index = self.response["output"].index(item)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        chat_index = int(call.get("index", 0))
        item = self._calls.get(chat_index)
        function = call.get("function") or {}
        if item is None:
            events += self._close_message()
            index = len(self.response["output"])
            item = {
                "id": f"fc_{index}_{self._suffix}",
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.get("id") or f"call_{index}_{self._suffix}",
                "name": function.get("name", ""),
                "arguments": "",
            }
            self.response["output"].append(item)
            self._calls[chat_index] = item
            events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            index = self.response["output"].index(item)
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=arguments,
                )
            )
        return events

    def _close_message(self) -> list[Event]:
        item, self._message = self._message, None
        if item is None:
            return []
        index = self.response["output"].index(item)
        part = item["content"][0]
        item["status"] = "completed"
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **common, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **common, part=dict(part)),
            self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item)),
        ]

    def _close_items(self) -> list[Event]:
        events = self._close_message()
        for item in self._calls.values():
            index = self.response["output"].index(item)
            item["status"] = "completed"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        self._calls = {}
        return events

    # --- the end ---------------------------------------------------------------------------------
    def _end_with_error(self, error: dict[str, Any]) -> list[Event]:
        events = self._close_items()
        self.ended = True
        code = str(error.get("code") or "server_error")
        message = str(error.get("message") or "the generation failed")
        # The SDK knows no `response.cancelled` event: a cancelled response ends with
        # `response.failed` whose response says status "cancelled" (docs/responses.md).
        cancelled = code in CANCELLED_CODES
        self.response["status"] = "cancelled" if cancelled else "failed"
        # OpenAI's cancelled response carries no error: it was stopped, nothing went wrong.
        self.response["error"] = None if cancelled else {"code": code, "message": message}
        return [*events, self._event("response.failed", response=self._snapshot())]

    def _usage(self, usage: dict[str, Any]) -> None:
        self.response["usage"] = {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        }

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def _event(self, kind: str, **fields: Any) -> Event:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence, **fields}


def _without_content(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": []}


TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}


def rebuilt_events(final: dict[str, Any]) -> list[Event]:
    """The events of a finished response rebuilt from its stored object, for a stream asked for
    after its log expired: the same event types a live reader got, with each item's text (or
    arguments) in one delta. So numbers after the first delta differ from the live ones
    (docs/responses.md)."""
    start = {**final, "output": [], "usage": None, "error": None, "incomplete_details": None}
    events: list[Event] = [
        {
            "type": "response.created",
            "response": {**start, "status": "queued" if final["background"] else "in_progress"},
        },
        {"type": "response.in_progress", "response": {**start, "status": "in_progress"}},
    ]
    for index, item in enumerate(final["output"]):
        events += _message_events(index, item) if item["type"] == "message" else _call_events(index, item)
    events.append({"type": TERMINAL_EVENTS.get(final["status"], "response.failed"), "response": final})
    return [{"type": e["type"], "sequence_number": n, **e} for n, e in enumerate(events)]


def _message_events(index: int, item: dict[str, Any]) -> list[Event]:
    part = item["content"][0] if item["content"] else {"type": "output_text", "text": "", "annotations": []}
    common = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        {
            "type": "response.output_item.added",
            "output_index": index,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **common, "part": {**part, "text": ""}},
        {"type": "response.output_text.delta", **common, "delta": part["text"], "logprobs": []},
        {"type": "response.output_text.done", **common, "text": part["text"], "logprobs": []},
        {"type": "response.content_part.done", **common, "part": part},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]


def _call_events(index: int, item: dict[str, Any]) -> list[Event]:
    common = {"item_id": item["id"], "output_index": index}
    added = {
        "type": "response.output_item.added",
        "output_index": index,
        "item": {**item, "status": "in_progress", "arguments": ""},
    }
    delta = (
        [{"type": "response.function_call_arguments.delta", **common, "delta": item["arguments"]}]
        if item["arguments"]
        else []
    )
    return [
        added,
        *delta,
        {
            "type": "response.function_call_arguments.done",
            **common,
            "name": item["name"],
            "arguments": item["arguments"],
        },
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]
