"""Cog inputs -> the OpenAI request a prediction stands for, validated like an HTTP body; and the
core's errors re-worded in the names of the Cog inputs that caused them. Pure: no I/O, no cog.

The runner's `Input()` declarations (cog/predict.py) take their bounds and defaults from here,
so the schema, the defaults and the translation cannot drift apart.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

import orjson

from shared.errors import BundleError, InvalidRequest
from shared.schemas import (
    MAX_STOP_LENGTH,
    MAX_STOP_SEQUENCES,
    PENALTY_RANGE,
    REQUEST_ID_MAX_LENGTH,
    SEED_MAX,
    TEMPERATURE_RANGE,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from shared.settings import Settings

__all__ = [  # the protocol's bounds, re-exported for cog/predict.py's Input() declarations
    "MAX_STOP_SEQUENCES",
    "PENALTY_RANGE",
    "REQUEST_ID_MAX_LENGTH",
    "SEED_MAX",
    "TEMPERATURE_RANGE",
]

# --- input bounds --------------------------------------------------------------------------
# The runner's Input(ge=, le=) bounds. The sampling bounds are the protocol's own constants; the
# token limit comes from the core's *default*, not from this process's environment: the bounds
# end up in `.cog/openapi_schema.json`, a build artefact that must not change with the machine
# that generated it. A deploy that lowers a limit through BUNDLE_* still gets it enforced by the
# core at admission (a failed prediction saying why).
MAX_TOKENS_LIMIT: int = Settings.model_fields["max_tokens_limit"].default
# The defaults of Replicate's LLM models (replicate/cog-vllm, the official Llama models), so a
# caller moving from those gets the same sampling without setting anything.
DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 0.9
DEFAULT_TOP_K = 50
# The protocol takes top_p in (0, 1]. Cog's Input has only inclusive bounds (ge/le), so the
# schema's floor is the smallest value we accept rather than 0: 0 gets 422, never the engine.
TOP_P_MIN = 0.001
TOP_K_MAX = 1_000_000  # the protocol has no upper bound (any vocabulary); Cog's schema wants one
PROMPT_TEMPLATE_FIELDS = ("prompt", "system_prompt")


def split_stop_sequences(value: str | Sequence[str] | None) -> list[str] | None:
    """Cog's `stop_sequences` -> the stop strings, whitespace kept ("\\n" and " User:" are real
    stop text). A value that parses as a JSON list of strings is that list (so a comma, or a
    newline typed as an escape in a web form, can be stop text); anything else is split at
    commas as before (Replicate's models take "a,b"; "[INST]" stays one stop). Empty parts are
    dropped; None when nothing is left."""
    if value is None:
        return None
    parts: list[str] = list(value) if not isinstance(value, str) else value.split(",")
    if isinstance(value, str) and (listed := _json_strings(value)) is not None:
        parts = listed
    stops = [part for part in parts if part]
    return stops or None


def _checked_stops(stops: list[str] | None) -> list[str] | None:
    """The protocol's limits, said in the Cog input's terms (pydantic's own message for a list
    in a str-or-list field names the str branch, which helps nobody)."""
    if stops and len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            f"stop_sequences takes up to {MAX_STOP_SEQUENCES} strings, got {len(stops)}", param="stop_sequences"
        )
    for stop in stops or ():
        if len(stop) > MAX_STOP_LENGTH:
            raise InvalidRequest(
                f"stop_sequences: each stop is at most {MAX_STOP_LENGTH} characters, one has {len(stop)}",
                param="stop_sequences",
            )
    return stops


def _json_strings(text: str) -> list[str] | None:
    if not text.lstrip().startswith("["):
        return None
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
        return parsed
    return None


def render_prompt_template(template: str, prompt: str, system_prompt: str) -> str:
    """`prompt_template` with {prompt} and {system_prompt} filled in; nothing else is a field
    (literal braces elsewhere, as in a JSON example, stay as written)."""
    if "{prompt}" not in template:
        raise InvalidRequest("prompt_template must contain {prompt}", param="prompt_template")
    # Not str.format: a template holding other braces would fail or leak attribute lookups.
    return template.replace("{system_prompt}", system_prompt).replace("{prompt}", prompt)


def request_from_inputs(
    settings: Settings,
    *,
    prompt: str,
    system_prompt: str = "",
    prompt_template: str = "",
    max_tokens: int = DEFAULT_MAX_TOKENS,
    min_tokens: int = 0,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    top_k: int = DEFAULT_TOP_K,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    stop_sequences: str | Sequence[str] | None = None,
    seed: int | None = None,
    json_schema: str = "",
    tools: str = "",
) -> ChatCompletionRequest | CompletionRequest:
    """The OpenAI request a Cog prediction stands for, validated like an HTTP body.

    With a `prompt_template` the rendered text goes to the engine as it is (a completion, no
    chat template); without, `prompt` and `system_prompt` are chat messages for the model's own
    chat template. `max_tokens` left at its default is sent as unset, so the core shrinks it to
    what the context leaves after the prompt instead of failing a long prompt (an explicit 512
    is indistinguishable from the default and gets the same leniency: it can only turn a failure
    into an answer). `stream` is False: the Cog path reads plain text, not SSE events.
    Problems raise `InvalidRequest` naming the Cog input, which the runner lets through as a
    failed prediction.
    """
    template = bool(prompt_template)
    sampling: dict[str, Any] = {
        "model": settings.model_name,
        "max_tokens": None if max_tokens == DEFAULT_MAX_TOKENS else max_tokens,
        "min_tokens": min_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k or None,  # Cog inputs need a number; 0 is "off" like vLLM's own 0/-1
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "stop": _checked_stops(split_stop_sequences(stop_sequences)),
        "seed": seed,
        "stream": False,
    }
    with cog_input_names(template=template):
        if template:
            if json_schema.strip() or tools.strip():
                raise InvalidRequest(
                    "json_schema and tools need the chat template: leave prompt_template empty",
                    param="prompt_template",
                )
            text = render_prompt_template(prompt_template, prompt, system_prompt)
            return parse_request(CompletionRequest, {**sampling, "prompt": text})
        body = {
            **sampling,
            "messages": _messages(prompt, system_prompt),
            "response_format": _schema_format(json_schema),
            "tools": _json_input(tools, "tools") if tools.strip() else None,
        }
        return parse_request(ChatCompletionRequest, body)


def chat_request_from_inputs(settings: Settings, **inputs: Any) -> ChatCompletionRequest:
    """`request_from_inputs` without a prompt template: always a chat request."""
    body = request_from_inputs(settings, **inputs)
    assert isinstance(body, ChatCompletionRequest), "a prompt_template makes a completion"
    return body


def _messages(prompt: str, system_prompt: str) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _json_input(text: str, name: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid JSON: {exc}", param=name) from None


def _schema_format(json_schema: str) -> dict[str, Any] | None:
    """Cog's `json_schema` string -> an OpenAI response_format, validated like the HTTP API's."""
    if not json_schema.strip():
        return None
    schema = _json_input(json_schema, "json_schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": True}}


# --- errors that name the Cog input --------------------------------------------------------------
# The core names its own fields (the HTTP API's): a Cog caller never sent `stop` or an
# `X-Request-Id` header, so errors are re-worded to the input that caused them.
_COG_NAMES = {
    "stop": "stop_sequences",
    "response_format": "json_schema",
    "X-Request-Id": "request_id",
    "max_completion_tokens": "max_tokens",
}
_CORE_NAME = re.compile(r"(?<![\w-])(" + "|".join(re.escape(name) for name in _COG_NAMES) + r")(?![\w-])")


def cog_param(param: str | None, *, template: bool) -> str | None:
    """A core error's `param` ("stop.0", "messages", "X-Request-Id") -> the Cog input's name."""
    if param is None:
        return None
    head = param.split(".", 1)[0]
    if head in ("messages", "prompt"):
        return "prompt_template" if template else "prompt"
    return _COG_NAMES.get(head, head)


def to_cog_error(exc: BundleError, *, template: bool = False) -> BundleError:
    """The same error, its message and `param` speaking of Cog inputs (changed in place: the
    class and code stay, so coglet reports the same kind of failure)."""
    message = exc.message
    if exc.param is not None and message.startswith(f"{exc.param}:"):  # "stop.0: ..." (pydantic's)
        message = f"{cog_param(exc.param, template=template)}:{message[len(exc.param) + 1 :]}"
    message = _CORE_NAME.sub(lambda match: _COG_NAMES[match.group(1)], message)
    exc.message, exc.args = message, (message,)
    exc.param = cog_param(exc.param, template=template)
    return exc


@contextlib.contextmanager
def cog_input_names(*, template: bool = False) -> Iterator[None]:
    try:
        yield
    except BundleError as exc:
        raise to_cog_error(exc, template=template) from exc.__cause__
