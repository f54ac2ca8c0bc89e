"""bench/wire.py: the refactor check compares what it should and normalises only what varies."""

from __future__ import annotations

from pathlib import Path

import orjson

from bench.wire import compare, normalise


def test_normalise_replaces_ids_and_timestamps_only() -> None:
    body = b'data: {"id":"chatcmpl-abc123","created":1765000000,"model":"tiny","choices":[{"text":"x"}]}'
    assert normalise(body) == b'data: {"id":"chatcmpl-ID","created":0,"model":"tiny","choices":[{"text":"x"}]}'
    assert normalise(b'{"id":"tiny","created":5}') == b'{"id":"tiny","created":0}'  # a model id stays


def _recording(path: Path, body: str) -> Path:
    exchange = {"name": "a", "status": 200, "headers": [["content-type", "text/event-stream"]], "body": body}
    path.write_bytes(orjson.dumps({"schema": "bundle-wire/1", "exchanges": [exchange]}))
    return path


def test_compare_fails_on_one_changed_byte(tmp_path: Path, capsys) -> None:
    old = _recording(tmp_path / "old.json", "data: [DONE]\n\n")
    assert compare(old, _recording(tmp_path / "same.json", "data: [DONE]\n\n")) == 0
    assert compare(old, _recording(tmp_path / "new.json", "data: [DONE]\n")) == 1
    assert "differs: a" in capsys.readouterr().out
