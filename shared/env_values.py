"""BUNDLE_* variables' text, both ways: the parsers behind `Settings`' fields, and the export of
explicitly given fields that rebuilds the same settings inside a deployed container.

The parsers run before pydantic's own validation (`BeforeValidator`), so each takes what a
constructor passes (already a value) as well as what the environment holds (text). The export is
shared by the core's `Settings` and Modal's `ModalSettings`: each writes its own prefix.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import SecretStr
from pydantic_settings import BaseSettings


def empty_is_none(value: Any) -> Any:
    """`BUNDLE_X=` (empty) means unset: no compile-cache pack, no shared store."""
    return value or None


def preset_or_none(value: Any) -> Any:
    """`BUNDLE_PRESET=` or `BUNDLE_PRESET=none`: no preset, even where a deploy defaults to one."""
    return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value


def json_or_none(value: Any) -> Any:
    """A JSON object given as text (`BUNDLE_SPECULATIVE_CONFIG`); empty means unset."""
    if isinstance(value, str) and value.strip():
        return json.loads(value)
    return value or None


def parse_lora_modules(value: Any) -> Any:
    """JSON object, or `name=source,name=source` (the form RunPod's LORA_MODULES users know)."""
    if not isinstance(value, str):
        return value or {}
    text = value.strip()
    if not text:
        return {}
    if text.startswith("{"):
        return json.loads(text)
    pairs = [part.partition("=") for part in text.split(",") if part.strip()]
    if any(not sep or not name.strip() or not source.strip() for name, sep, source in pairs):
        raise ValueError("BUNDLE_LORA_MODULES takes JSON or name=source pairs separated by commas")
    return {name.strip(): source.strip() for name, _, source in pairs}


def explicit_variables(settings: BaseSettings) -> dict[str, str]:
    """The variables (the settings class's own prefix) of the fields given explicitly.

    Defaults are left out, so they stay owned by the code the container runs; so are unset
    values and secrets, which travel in a platform secret, not in an image layer or an app
    definition. Booleans are written `true`/`false` and dicts as JSON, as the parsers read them.
    """
    prefix = settings.model_config.get("env_prefix", "")
    env: dict[str, str] = {}
    for name in sorted(settings.model_fields_set):
        value = getattr(settings, name)
        if value is None or isinstance(value, SecretStr):
            continue
        if type(settings).model_fields[name].validation_alias is not None:
            # A standard or platform variable (OTEL_*, MODAL_*): the platform or its secret sets
            # it in the container; the deploy never writes it.
            continue
        if isinstance(value, bool):
            rendered = "true" if value else "false"
        elif isinstance(value, dict):
            rendered = json.dumps(value)
        else:
            rendered = str(value)
        env[f"{prefix}{name.upper()}"] = rendered
    return env
