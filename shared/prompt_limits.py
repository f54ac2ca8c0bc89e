"""A cheap bound on prompt size, checked before anything tokenises.

Tokenising costs time proportional to the text (issue 18 measured about a second per megabyte
on the 2-core test box), so a prompt that cannot fit must be refused without it. How many
characters can `max_prompt_tokens` tokens span? BPE vocabularies hold some long tokens (runs of
spaces, `=` or `-` in code), but text averages 3-5 characters per token in English and fewer in
most other languages. 32 characters per token (`BUNDLE_PROMPT_CHARS_PER_TOKEN`) leaves room for
prompts full of long runs, yet refuses a 1 MB prompt against the default 8,192-token limit (cap
262,144 characters) before a single token is made. The exact token limit is still enforced after
tokenising; this bound only refuses prompts far beyond it.
"""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequest
from shared.settings import Settings


def check_prompt_size(body: Any, settings: Settings) -> None:
    """Refuse (400, `context_length_exceeded`) a prompt that cannot fit, without tokenising."""
    limit_tokens = settings.max_prompt_tokens
    limit_chars = limit_tokens * settings.prompt_chars_per_token
    messages = getattr(body, "messages", None)
    if messages is not None:
        size = sum(_text_length(getattr(message, "content", None)) for message in messages)
        param = "messages"
    else:
        prompt = getattr(body, "prompt", "")
        if isinstance(prompt, list):  # token ids: the count is known without tokenising
            if len(prompt) > limit_tokens:
                raise _too_long(f"prompt has {len(prompt)} tokens; the limit is {limit_tokens}", "prompt")
            return
        size, param = _text_length(prompt), "prompt"
    if size > limit_chars:
        raise _too_long(
            f"prompt has {size} characters, more than {limit_tokens} tokens can hold here "
            f"(limit {limit_chars} characters)",
            param,
        )


def _text_length(value: Any) -> int:
    """Characters of text in a message content: a string, or a list of parts (any nesting)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple):
        return sum(_text_length(item) for item in value)
    if isinstance(value, dict):
        return sum(_text_length(item) for item in value.values())
    fields = getattr(value, "__dict__", None)
    return _text_length(fields) if isinstance(fields, dict) else 0


def _too_long(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param=param, code="context_length_exceeded")
