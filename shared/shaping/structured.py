"""Structured output: what a request constrains its output to, checked before the engine.

The constraint is applied by vLLM's structured-output backend (a grammar masks every token that
would break the JSON), so the output is valid even from a model that knows nothing of JSON
(the random-weight tiny model included). `shared.engine.vllm._structured_outputs` turns it into vLLM's
parameters; everything here is vLLM-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.engine.contract import OutputConstraint
from shared.errors import InvalidRequest

MAX_SCHEMA_BYTES = 64 * 1024  # far above real tool/response schemas; bounds grammar compile time


def check_json_schema(schema: Mapping[str, Any], param: str) -> None:
    """400 unless `schema` is a valid JSON Schema (checked against the metaschema)."""
    import jsonschema
    import orjson

    if len(orjson.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"{param}: the schema exceeds {MAX_SCHEMA_BYTES} bytes", param=param)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequest(f"{param}: not a valid JSON schema: {exc.message}", param=param) from None


def response_constraint(response_format: Any) -> OutputConstraint | None:
    """The constraint of an OpenAI `response_format` (None for plain text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return OutputConstraint()
    schema = response_format.json_schema.schema_
    check_json_schema(schema, "response_format.json_schema.schema")
    return OutputConstraint(json_schema=schema)
