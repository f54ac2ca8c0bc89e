"""From an OpenAI request to the engine's `SamplingRequest`: every check a request passes before
it may run, and the building. Pure functions: no I/O, no state (tokenizing is the engine's CPU work).

Each check raises `InvalidRequest` (a 400 with the OpenAI error's `param` and `code`), so the door
refuses bad input before anything is claimed, registered or sent to the engine.
"""

from __future__ import annotations

import hashlib

import orjson

from shared.engine.contract import Engine, OutputConstraint, SamplingRequest
from shared.engine.lora import Adapter
from shared.errors import InvalidRequest
from shared.schemas import ChatCompletionRequest, CompletionRequest
from shared.settings import Settings
from shared.shaping.choices import Choices
from shared.shaping.structured import response_constraint
from shared.shaping.tools import check_tool_schemas, forced_constraint, shaper_for
from shared.streaming import Kind

OpenAIRequest = ChatCompletionRequest | CompletionRequest
MAX_CHARS_PER_TOKEN = 32  # ordinary text averages ~4 characters per token


def fingerprint(kind: Kind, body: OpenAIRequest) -> str:
    """Identity of a request body, independent of key order and whitespace. Every field the
    request schema knows is covered (tools, response_format, n, logprobs...); an explicit null
    never reaches here (the schema drops it), so it is the same request as the field left out."""
    canonical = orjson.dumps(
        {"kind": kind, "body": body.model_dump(mode="json", exclude_unset=True, by_alias=True)},
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(canonical).hexdigest()


def prompt_chars(body: OpenAIRequest) -> int:
    """Characters of text the prompt carries (token-id prompts count as none)."""
    if isinstance(body, ChatCompletionRequest):
        return sum(_content_chars(message.content) for message in body.messages)
    return len(body.prompt) if isinstance(body.prompt, str) else 0


def check_prompt_size(body: OpenAIRequest, chars: int, settings: Settings) -> None:
    """Refuse prompts that cannot fit before paying to tokenize them (a 1 MB prompt costs about a
    second of CPU): no tokenizer in use packs more than MAX_CHARS_PER_TOKEN characters into one
    token on ordinary text, so more characters than that many times the token limit can only be
    refused after tokenizing anyway."""
    limit = settings.max_prompt_tokens * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise InvalidRequest(
            f"prompt has {chars} characters; at most {limit} can fit the limit of "
            f"{settings.max_prompt_tokens} tokens",
            param=_prompt_param(body),
            code="context_length_exceeded",
        )


def prompt_ids(body: OpenAIRequest, engine: Engine, settings: Settings) -> list[int]:
    """The prompt's token ids: the chat template applied, the text tokenized, or the ids given
    (checked against the vocabulary); refused past `max_prompt_tokens`."""
    if isinstance(body, ChatCompletionRequest):
        ids = engine.render_chat(body.message_dicts(), body.tool_dicts())
    elif isinstance(body.prompt, list):
        ids = _checked_token_ids(body.prompt, engine)
    else:
        ids = engine.tokenize(body.prompt)
    if len(ids) > settings.max_prompt_tokens:
        raise InvalidRequest(
            f"prompt has {len(ids)} tokens; the limit is {settings.max_prompt_tokens}",
            param=_prompt_param(body),
            code="context_length_exceeded",
        )
    return ids


def sampling_request(
    body: OpenAIRequest,
    ids: list[int],
    engine: Engine,
    settings: Settings,
    *,
    adapter: Adapter | None,
    stream_interval: int | None,
) -> SamplingRequest:
    """What the engine runs for `body`, its prompt rendered to `ids`; the limits checked."""
    max_tokens = _max_tokens(body, len(ids), engine, settings)
    if body.n > settings.max_n:
        raise InvalidRequest(f"n {body.n} exceeds this server's limit of {settings.max_n}", param="n")
    logit_bias = body.logit_bias_ids
    _checked_token_ids(list(logit_bias), engine, "logit_bias")
    _checked_token_ids(body.stop_token_ids or [], engine, "stop_token_ids")
    return SamplingRequest(
        prompt_token_ids=ids,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop_list,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        ignore_eos=body.ignore_eos,
        n=body.n,
        logprobs=body.top_logprobs_count,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=logit_bias,
        constraint=_constraint(body, engine),
        stream_interval=stream_interval,
        adapter=adapter,
    )


def output_choices(kind: Kind, body: OpenAIRequest, engine: Engine) -> Choices | None:
    """The slow output path, only for requests that need it (see shared/shaping/choices.py)."""
    with_logprobs = body.top_logprobs_count is not None
    tools = isinstance(body, ChatCompletionRequest) and body.uses_tools
    if body.n == 1 and not with_logprobs and not tools:
        return None
    if not tools:
        return Choices(kind, body.n, with_logprobs=with_logprobs)
    return Choices(kind, body.n, with_logprobs=with_logprobs, shaper_factory=lambda: shaper_for(body, engine))


def _max_tokens(body: OpenAIRequest, prompt_tokens: int, engine: Engine, settings: Settings) -> int:
    """The request's max_tokens (or the default that fits), within the server's limit and the
    model's context."""
    limit = settings.max_tokens_limit
    max_tokens = body.requested_max_tokens
    if max_tokens is not None and max_tokens > limit:
        raise InvalidRequest(
            f"max_tokens {max_tokens} exceeds this server's limit of {limit}", param="max_tokens"
        )
    context = engine.info.max_model_len
    room = context - prompt_tokens
    if max_tokens is None:
        max_tokens = min(settings.default_max_tokens, room)
    if max_tokens > room or room <= 0:
        raise InvalidRequest(
            f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"model's context of {context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _checked_token_ids(ids: list[int], engine: Engine, param: str = "prompt") -> list[int]:
    vocabulary = engine.info.vocab_size
    if ids and vocabulary and max(ids) >= vocabulary:
        raise InvalidRequest(
            f"{param} token id {max(ids)} is outside the vocabulary of {vocabulary}", param=param
        )
    return ids


def _constraint(body: OpenAIRequest, engine: Engine) -> OutputConstraint | None:
    """What the output is constrained to (a forced tool call's JSON, or response_format's), once
    the engine has said it can enforce it."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    if body.uses_tools:
        check_tool_schemas(body.tools or [])
        if body.forced_tool_call:
            forced = forced_constraint(body.tools or [], body.tool_choice, body.parallel_tool_calls)
            engine.check_constraint(forced, "tools")
            return forced
    constraint = response_constraint(body.response_format)
    if constraint is not None:
        engine.check_constraint(constraint, "response_format")
    return constraint


def _prompt_param(body: OpenAIRequest) -> str:
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: count their text
        return sum(len(getattr(part, "text", None) or "") for part in content)
    return 0
