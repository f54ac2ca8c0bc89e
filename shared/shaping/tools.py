"""Tool calls: the schema that forces one, and shapers that turn a choice's output into
OpenAI `tool_calls` deltas.

`tool_choice` decides the shaper:
- a named function: the output is constrained to that function's arguments (JSON), so every
  piece of text is streamed as an arguments delta of one call;
- "required": the output is constrained to a JSON array of {"name", "parameters"} (the shape
  vLLM's own server uses), parsed when the choice ends;
- "auto": the output runs free and the model's own format is parsed by vLLM's tool parser
  (`shared.engine.vllm_tools`, chosen by BUNDLE_TOOL_CALL_PARSER).
A shaper lives in the generation's producer, so what it emits is stored once in the replay
buffer: attach, replay and resume get the same ids and the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from shared.engine.contract import OutputConstraint, ToolCallShaper, ToolDelta, call_more, call_start
from shared.shaping.structured import check_json_schema

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_of(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def check_tool_schemas(tools: Sequence[Any]) -> None:
    for position, tool in enumerate(tools):
        if tool.function.parameters is not None:
            check_json_schema(tool.function.parameters, f"tools.{position}.function.parameters")


def forced_constraint(tools: Sequence[Any], tool_choice: Any, parallel: bool) -> OutputConstraint:
    """The grammar for a forced call: the named function's arguments, or (required) an array of
    calls to any of the tools (exactly one when parallel calls are off)."""
    if not isinstance(tool_choice, str):
        chosen = next(t for t in tools if t.function.name == tool_choice.function.name)
        return OutputConstraint(json_schema=parameters_of(chosen))
    one_call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters_of(tool),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }
    array: dict[str, Any] = {"type": "array", "items": one_call, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return OutputConstraint(json_schema=array)


class NamedCall:
    """Output constrained to one function's arguments: stream it as that call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str, token_ids: Sequence[int]) -> ToolDelta:
        if not text:
            return ToolDelta()
        if self.started:
            return ToolDelta(calls=[call_more(0, text)])
        self.started = True
        return ToolDelta(calls=[call_start(0, self.name, text)])

    def finish(self) -> ToolDelta:
        if self.started:
            return ToolDelta()
        self.started = True  # a call with no output at all (max_tokens 0 is refused; defensive)
        return ToolDelta(calls=[call_start(0, self.name, "")])


class RequiredCalls:
    """Output constrained to a JSON array of calls: complete only at the end, parsed then."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def feed(self, text: str, token_ids: Sequence[int]) -> ToolDelta:
        self.parts.append(text)
        return ToolDelta()

    def finish(self) -> ToolDelta:
        text = "".join(self.parts)
        try:
            calls = json.loads(text)
            deltas = [
                call_start(index, call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                for index, call in enumerate(calls)
            ]
        except (ValueError, TypeError, KeyError):
            # Cut short (max_tokens) before the array closed: hand back what there is as text.
            return ToolDelta(content=text or None)
        return ToolDelta(calls=deltas)


def shaper_for(body: Any, engine: Any) -> ToolCallShaper | None:
    """The shaper of one choice of this chat request, or None when tools are not in play."""
    if not body.uses_tools:
        return None
    if body.tool_choice == "required":
        return RequiredCalls()
    if body.tool_choice not in (None, "auto"):
        return NamedCall(body.tool_choice.function.name)
    return engine.tool_parser(body.tool_dicts())  # type: ignore[no-any-return]
