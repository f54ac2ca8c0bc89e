"""OpenAI request schemas: what the API accepts, checked before anything reaches the engine.

Unknown fields are refused rather than silently ignored: a client that asks for `logprobs` or
`tools` must learn that this server does not do them, not get an answer without them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from shared.errors import InvalidRequest

RequestModel = TypeVar("RequestModel", bound=BaseModel)

# The bounds of the sampling fields, named once: the Cog runner's inputs are built from these.
TEMPERATURE_RANGE = (0.0, 2.0)
PENALTY_RANGE = (-2.0, 2.0)
SEED_MAX = 2**63 - 1
MAX_STOP_SEQUENCES = 4
REQUEST_ID_MAX_LENGTH = 256  # X-Request-Id (and Cog's request_id input)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid", str_max_length=2_000_000)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=TEMPERATURE_RANGE[0], le=TEMPERATURE_RANGE[1])
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    ignore_eos: StrictBool = False  # vLLM extension; benchmarks use it for fixed output lengths
    # Accepted because they change nothing about the generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_SEQUENCES or any(not stop for stop in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_SEQUENCES} non-empty strings")
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)

    def message_dicts(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in self.messages
        ]


class CompletionRequest(_SamplingFields):
    # OpenAI's legacy endpoint also takes a prompt as token ids; benchmarks use it to send
    # exactly N tokens to every server.
    prompt: str | list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    echo: Literal[False] = False
    suffix: None = None


def parse_request(model: type[RequestModel], body: Any) -> RequestModel:
    """Validate a decoded JSON body, turning the first problem into one clear OpenAI error."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _as_invalid_request(exc) from None


def _as_invalid_request(exc: ValidationError) -> InvalidRequest:
    error = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in error["loc"]) or None
    if error["type"] == "extra_forbidden":
        return InvalidRequest(f"unsupported parameter: {param}", param=param, code="unsupported_parameter")
    message = f"{param}: {error['msg']}" if param else error["msg"]
    return InvalidRequest(message, param=param, code="invalid_value")
