"""`tool_choice` "auto": the model's own tool-call format, parsed by vLLM's tool parsers.

The parser is chosen by name (BUNDLE_TOOL_CALL_PARSER: "llama3_json" for Llama 3.x, "hermes"
for Hermes/Qwen-style `<tool_call>` tags, any name vLLM registers). Its streaming method follows
the text as it grows; some parsers hold back the tail of the arguments until they see the end, so
at the end of the choice we parse the whole text once more and send whatever the stream did not.
The deltas then always join to the whole-text result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shared.engine.contract import ToolDelta, call_more, call_start
from shared.errors import InvalidRequest

if TYPE_CHECKING:
    from vllm.tool_parsers.utils import Tool


class VLLMToolParser:
    """`ToolCallShaper` over one vLLM `ToolParser` instance (they are stateful: one per choice)."""

    def __init__(self, name: str, tokenizer: Any, tools: Sequence[dict[str, Any]], model: str) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        try:
            parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise InvalidRequest(f"this server's tool-call parser {name!r} is unknown to vLLM") from None
        self._request = ChatCompletionRequest.model_validate(
            {"model": model, "messages": [{"role": "user", "content": ""}], "tools": list(tools)}
        )
        # A list of vLLM's wider `Tool` union: lists are invariant, so the request's own list of
        # chat tools does not pass as one, though every item is a `Tool`.
        tools_param: list[Tool] | None = None if self._request.tools is None else list(self._request.tools)
        self._parser = parser_class(tokenizer, tools_param)
        self._text = ""
        self._ids: list[int] = []
        self._streamed: dict[int, str] = {}  # call index -> arguments sent so far
        self._named: set[int] = set()

    def feed(self, text: str, token_ids: Sequence[int]) -> ToolDelta:
        previous_text, previous_ids = self._text, self._ids
        self._text = previous_text + text
        self._ids = previous_ids + list(token_ids)
        message = self._parser.extract_tool_calls_streaming(
            previous_text, self._text, text, previous_ids, self._ids, list(token_ids), self._request
        )
        if message is None:
            return ToolDelta()
        return ToolDelta(content=message.content or None, calls=[self._call(c) for c in message.tool_calls])

    def _call(self, delta: Any) -> dict[str, Any]:
        function = delta.function or {}
        if not isinstance(function, dict):
            function = function.model_dump(exclude_none=True)
        arguments = function.get("arguments") or ""
        self._streamed[delta.index] = self._streamed.get(delta.index, "") + arguments
        if delta.index not in self._named and function.get("name"):
            self._named.add(delta.index)
            return call_start(delta.index, function["name"], arguments)
        return call_more(delta.index, arguments)

    def finish(self) -> ToolDelta:
        whole = self._parser.extract_tool_calls(self._text, self._request)
        if not whole.tools_called:
            return ToolDelta()
        calls = []
        for index, call in enumerate(whole.tool_calls):
            sent = self._streamed.get(index, "")
            arguments = call.function.arguments
            if index not in self._named:
                calls.append(call_start(index, call.function.name, arguments))
            elif arguments.startswith(sent) and len(arguments) > len(sent):
                calls.append(call_more(index, arguments[len(sent) :]))
        return ToolDelta(calls=calls)
