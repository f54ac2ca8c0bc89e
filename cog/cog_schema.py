"""Write the OpenAPI document Cog's server reads from `.cog/openapi_schema.json`.

`cog build` (a Go binary, not installable here) normally writes that file into the image. The
local server (`python -m cog.server.http`) needs it too: without it coglet 0.23.1 refuses
`Accept: text/event-stream` (406) and checks no inputs. It reads exactly two things from it:
`paths["/predictions"].post["x-cog-streaming"]` and `components.schemas.Input`, which it compiles
into a JSON-schema validator (out-of-range input -> 422 before the runner is called).

Usage (from the repository root, as `make cog-schema` does):
    python cog/cog_schema.py cog/predict.py:Runner > .cog/openapi_schema.json

The document is derived from the runner's `run()` signature alone (types, `Input(...)` bounds,
defaults), so tests/test_cog.py can regenerate it and fail when the checked-in file drifts.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

_SCALARS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
# `@cog.streaming` is a no-op at runtime; like `cog build`, we detect it in the source.
_STREAMING_DECORATOR = re.compile(r"^\s*@(?:cog\.)?streaming\b", re.MULTILINE)


def load_runner(ref: str) -> type:
    """'cog/predict.py:Runner' -> the class, imported the way coglet imports it."""
    path, _, name = ref.partition(":")
    module_name = Path(path).stem
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return typing.cast(type, getattr(module, name or "Runner"))


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _json_type(annotation: Any) -> dict[str, Any]:
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return {"type": "array", "items": _json_type(item)}
    raise SystemExit(f"unsupported input type for this generator: {annotation!r}")


def _property(name: str, order: int, annotation: Any, default: Any) -> tuple[dict[str, Any], bool]:
    """One input's JSON schema, and whether the input is required."""
    inner, nullable = _unwrap_optional(annotation)
    prop: dict[str, Any] = {"title": name.replace("_", " ").title(), "x-order": order}
    prop.update(_json_type(inner))
    info = default if type(default).__name__ == "FieldInfo" else None  # cog.Input(...)
    value = info.default if info is not None else default
    if info is not None:
        for attr, key in (
            ("description", "description"),
            ("ge", "minimum"),
            ("le", "maximum"),
            ("min_length", "minLength"),
            ("max_length", "maxLength"),
            ("regex", "pattern"),
        ):
            if getattr(info, attr) is not None:
                prop[key] = getattr(info, attr)
        if info.choices is not None:
            prop["enum"] = list(info.choices)
    missing = value is inspect.Parameter.empty or (value is None and not nullable)
    if value is not inspect.Parameter.empty and value is not None:
        prop["default"] = value
    if nullable:
        prop["nullable"] = True
    return prop, missing


def _output_schema(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation) or annotation
    name = getattr(origin, "__name__", "")
    if name in ("ConcatenateIterator", "AsyncConcatenateIterator"):
        (item,) = typing.get_args(annotation) or (str,)
        return {
            "title": "Output",
            "type": "array",
            "items": _json_type(item),
            "x-cog-array-type": "iterator",
            "x-cog-array-display": "concatenate",
        }
    if name in ("Iterator", "AsyncIterator"):
        (item,) = typing.get_args(annotation)
        return {
            "title": "Output",
            "type": "array",
            "items": _json_type(item),
            "x-cog-array-type": "iterator",
        }
    return {"title": "Output", **_json_type(annotation)}


def build_schema(runner: type) -> dict[str, Any]:
    run = runner.run  # type: ignore[attr-defined]
    hints = typing.get_type_hints(run)
    properties: dict[str, Any] = {}
    required: list[str] = []
    params = [p for p in inspect.signature(run).parameters.values() if p.name != "self"]
    for order, param in enumerate(params):
        prop, missing = _property(param.name, order, hints[param.name], param.default)
        properties[param.name] = prop
        if missing:
            required.append(param.name)
    input_schema: dict[str, Any] = {"title": "Input", "type": "object", "properties": properties}
    if required:
        input_schema["required"] = required
    predict: dict[str, Any] = {
        "summary": "Predict",
        "operationId": "predict_predictions_post",
        "requestBody": _json_body("PredictionRequest"),
        "responses": {
            "200": {"description": "Successful Response", **_json_body("PredictionResponse")},
            "422": {"description": "Validation Error"},
        },
    }
    if _STREAMING_DECORATOR.search(inspect.getsource(run)):
        predict["x-cog-streaming"] = True
    return {
        "openapi": "3.0.2",
        "info": {"title": "Cog", "version": "0.1.0"},
        "paths": {
            "/predictions": {"post": predict},
            "/predictions/{prediction_id}/cancel": {
                "post": {
                    "summary": "Cancel",
                    "operationId": "cancel_predictions__prediction_id__cancel_post",
                    "parameters": [
                        {
                            "name": "prediction_id",
                            "in": "path",
                            "required": True,
                            "schema": {"title": "Prediction ID", "type": "string"},
                        }
                    ],
                    "responses": {"200": {"description": "Successful Response"}},
                }
            },
        },
        "components": {
            "schemas": {
                "Input": input_schema,
                "Output": _output_schema(hints["return"]),
                "PredictionRequest": {
                    "title": "PredictionRequest",
                    "type": "object",
                    "properties": {
                        "id": {"title": "Id", "type": "string"},
                        "input": {"$ref": "#/components/schemas/Input"},
                    },
                },
                "PredictionResponse": {
                    "title": "PredictionResponse",
                    "type": "object",
                    "properties": {
                        "id": {"title": "Id", "type": "string"},
                        "input": {"$ref": "#/components/schemas/Input"},
                        "output": {"$ref": "#/components/schemas/Output"},
                        "status": {"title": "Status", "type": "string"},
                        "error": {"title": "Error", "type": "string"},
                        "logs": {"title": "Logs", "type": "string"},
                        "metrics": {"title": "Metrics", "type": "object"},
                    },
                },
            }
        },
    }


def _json_body(schema: str) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def render(ref: str) -> str:
    return json.dumps(build_schema(load_runner(ref)), indent=2) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 1 or ":" not in argv[0]:
        raise SystemExit("usage: python cog/cog_schema.py cog/predict.py:Runner")
    sys.stdout.write(render(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:])
