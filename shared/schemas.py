"""OpenAI request schemas: what the API accepts, checked before anything reaches the engine.

Strict on purpose: types are not coerced (`"max_tokens": "10"` or `true` is a 400, not 10 or 1),
and unknown fields are refused rather than silently ignored, so a client learns what this server
does not do instead of getting an answer without it. An explicit `null` for an optional
top-level field means "not set" (clients such as vLLM's own benchmark send `"logprobs": null`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.errors import InvalidRequest

RequestModel = TypeVar("RequestModel", bound=BaseModel)

# The bounds of the sampling fields, named once: the Cog runner's inputs are built from these.
TEMPERATURE_RANGE = (0.0, 2.0)
PENALTY_RANGE = (-2.0, 2.0)
REPETITION_PENALTY_MAX = 2.0
SEED_MAX = 2**63 - 1
MAX_STOP_SEQUENCES = 4
# vLLM holds back the last (longest stop string - 1) characters of a stream until it knows they
# do not start a stop string, so a 100 KB stop string withholds the whole output until the end.
# 256 characters bounds that hold-back to a few dozen tokens and is far longer than any real
# stop marker (chat templates' end tags are under 20).
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy endpoint
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
REQUEST_ID_MAX_LENGTH = 256  # X-Request-Id (and Cog's request_id input)
MEDIA_PARTS = frozenset({"image_url", "input_audio", "audio_url", "video_url", "file", "image", "audio"})

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
TokenId = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class _Strict(BaseModel):
    # strict: no "10" -> 10, no true -> 1; ints are still accepted where a float is expected.
    model_config = ConfigDict(extra="forbid", strict=True, str_max_length=2_000_000)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: Probability = 0.0
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: StopString | list[StopString] | None = Field(None)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # the server's own cap (BUNDLE_MAX_N) is checked at admission
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # vLLM extensions that its own clients send (benchmarks use ignore_eos for fixed lengths).
    repetition_penalty: float = Field(1.0, gt=0.0, le=REPETITION_PENALTY_MAX)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    # Accepted because they change nothing about the generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"stop takes up to {MAX_STOP_SEQUENCES} strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"logit_bias keys are token ids as strings, got {key[:20]!r}")
        return value

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(key): bias for key, bias in (self.logit_bias or {}).items()}

    @property
    def top_logprobs_count(self) -> int | None:
        """How many alternatives per token to return; None: no logprobs at all."""
        return None


# --- chat messages --------------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise ValueError(f"content parts of type {kind!r} are not supported: the model reads text only")
        return value

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool messages need tool_call_id, and only they may carry one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: plain text content, a known role, and
        tool-call arguments as objects (Llama 3.1's template serialises them itself)."""
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = self.text
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        return message


def _template_call(call: ToolCall) -> dict[str, Any]:
    import json

    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


# --- tools and structured output -----------------------------------------------------------------
class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only there")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_choices(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        constrained_format = self.response_format is not None and self.response_format.type != "text"
        if self.forced_tool_call and constrained_format:
            raise ValueError("a forced tool call and response_format cannot both constrain the output")
        return self

    @property
    def uses_tools(self) -> bool:
        """Tools are rendered into the prompt and looked for in the output."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool_call(self) -> bool:
        named = isinstance(self.tool_choice, NamedToolChoice)
        return self.uses_tools and (self.tool_choice == "required" or named)

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [message.template_dict() for message in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        if not self.uses_tools:
            return None
        return [tool.model_dump(mode="json", exclude_none=True) for tool in self.tools or ()]


class CompletionRequest(_SamplingFields):
    # OpenAI's legacy endpoint also takes a prompt as token ids; benchmarks use it to send
    # exactly N tokens to every server.
    prompt: str | list[TokenId] = Field(min_length=1)
    echo: Literal[False] = False
    suffix: None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs


# --- LoRA adapters at runtime (vLLM's own routes and bodies) -----------------------------------------
class LoadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)  # a directory, a Hugging Face id or a tar URL


class UnloadAdapterRequest(_Strict):
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None  # vLLM's body has it; the name alone decides here


def parse_request(model: type[RequestModel], body: Any) -> RequestModel:
    """Validate a decoded JSON body, turning the first problem into one clear OpenAI error."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise as_invalid_request(exc) from None


def as_invalid_request(exc: ValidationError, under: str = "") -> InvalidRequest:
    """The first problem as one clear OpenAI error; `under` prefixes its parameter's path (a part
    of the body validated on its own, e.g. `input.2`)."""
    error = exc.errors(include_url=False)[0]
    path = [under] if under else []
    param = ".".join([*path, *(str(part) for part in error["loc"])]) or None
    if error["type"] == "extra_forbidden":
        return InvalidRequest(f"unsupported parameter: {param}", param=param, code="unsupported_parameter")
    message = f"{param}: {error['msg']}" if param else error["msg"]
    return InvalidRequest(message, param=param, code="invalid_value")
