"""The settings object's contract with deploys: variable names, sections, units and the docs.

Users' deploys set BUNDLE_* variables, so their names are frozen here as they stood on main before
the fields were grouped into sections (`git show main:shared/settings.py`, 2026-12-01). A rename,
a removal or an addition fails `test_variable_names_are_the_published_ones`: a rename must not
happen, and an addition is a decision that belongs in this list (and in the docs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings

from modal_app.settings import ModalSettings
from shared.settings import Section, Settings

ROOT = Path(__file__).resolve().parent.parent

PUBLISHED = frozenset({
    'BUNDLE_ACCESS_LOG', 'BUNDLE_API_KEY', 'BUNDLE_API_PROCESSES', 'BUNDLE_BLOCK_SIZE', 'BUNDLE_CACHE_DIR',
    'BUNDLE_COMPACT_JSON',
    'BUNDLE_COMPILE_CACHE', 'BUNDLE_COMPILE_CACHE_DIR',  # issue 38: the compile-cache pack
    'BUNDLE_CUDA_GRAPH_MAX_BATCH', 'BUNDLE_DEFAULT_MAX_TOKENS', 'BUNDLE_DISCONNECT_GRACE_S',
    'BUNDLE_DTYPE', 'BUNDLE_ENABLE_LORA', 'BUNDLE_ENABLE_PREFIX_CACHING', 'BUNDLE_ENFORCE_EAGER',
    'BUNDLE_ENGINE_SEED', 'BUNDLE_ENGINE_STATS_FILE', 'BUNDLE_ENGINE_STATS_INTERVAL_S', 'BUNDLE_GC_THRESHOLDS',
    'BUNDLE_GPU_MEMORY_UTILIZATION', 'BUNDLE_HEADER_TIMEOUT_S', 'BUNDLE_HOST', 'BUNDLE_KEEP_ALIVE_S',
    'BUNDLE_LOAD_FORMAT', 'BUNDLE_LOG_LEVEL', 'BUNDLE_LORA_CACHE_DIR', 'BUNDLE_LORA_MODULES',
    'BUNDLE_LORA_RUNTIME_LOADING', 'BUNDLE_MAX_BODY_BYTES', 'BUNDLE_MAX_EVENTS_PER_REQUEST',
    'BUNDLE_MAX_HEADER_BYTES', 'BUNDLE_MAX_HEADER_COUNT', 'BUNDLE_MAX_HELD_REQUESTS',
    'BUNDLE_MAX_IN_FLIGHT', 'BUNDLE_MAX_LOADED_LORAS', 'BUNDLE_MAX_LORAS', 'BUNDLE_MAX_LORA_RANK',
    'BUNDLE_MAX_MODEL_LEN', 'BUNDLE_MAX_N', 'BUNDLE_MAX_NUM_BATCHED_TOKENS', 'BUNDLE_MAX_NUM_SEQS',
    'BUNDLE_MAX_PROMPT_TOKENS', 'BUNDLE_MAX_TOKENS_LIMIT', 'BUNDLE_MODEL', 'BUNDLE_MODEL_REVISION',
    'BUNDLE_PORT', 'BUNDLE_PRESET', 'BUNDLE_QUANTIZATION', 'BUNDLE_REDIS_URL',
    'BUNDLE_REDIS_WRITE_WINDOW_MS', 'BUNDLE_REQUEST_TIMEOUT_S', 'BUNDLE_RETENTION_S',
    'BUNDLE_RESPONSES_MAX_RECORD_BYTES', 'BUNDLE_RESPONSES_MAX_STORED', 'BUNDLE_RESPONSES_RETENTION_S',
    'BUNDLE_RETRY_AFTER_S', 'BUNDLE_SERVED_MODEL_NAME', 'BUNDLE_SHUTDOWN_GRACE_S', 'BUNDLE_SLEEP_MODE',
    'BUNDLE_SPECULATIVE_CONFIG', 'BUNDLE_STREAM_BATCH_AT', 'BUNDLE_STREAM_COALESCE_MS',
    'BUNDLE_STREAM_DIRECT_WRITES', 'BUNDLE_STREAM_INTERVAL', 'BUNDLE_TAKEOVER', 'BUNDLE_TENSOR_PARALLEL_SIZE',
    'BUNDLE_TINY_MODEL_SEED',
    'BUNDLE_TINY_MODEL_SHAPE', 'BUNDLE_TOOL_CALL_PARSER', 'BUNDLE_TRUST_REMOTE_CODE', 'BUNDLE_WAKE_SLOW_S',
    'BUNDLE_WAKE_WAIT_S', 'BUNDLE_WARM_UP',
    # issue 52: telemetry. The OTLP switch is the standard variable, the container's identity the
    # platforms' own (read, never written by a deploy).
    'BUNDLE_TTFT_SLA_S', 'BUNDLE_SCHEDULER_STATS', 'BUNDLE_ENGINE_TRACES', 'OTEL_EXPORTER_OTLP_ENDPOINT',
    'MODAL_TASK_ID', 'MODAL_ENVIRONMENT', 'MODAL_REGION',
    'REPLICATE_MODEL_NAME', 'REPLICATE_VERSION_ID', 'REPLICATE_DEPLOYMENT_NAME',
})  # fmt: skip

# Durations in milliseconds: kept because their variables name the unit (module docstring).
MILLISECOND_FIELDS = frozenset({"redis_write_window_ms", "stream_coalesce_ms"})
# Words that make a field a duration; such a field must say its unit in its name.
DURATION_WORDS = ("timeout", "grace", "window", "wait", "retention", "keep_alive", "slow", "coalesce")
# Read by tests/conftest.py only, not by the bundle.
TEST_ONLY_VARIABLES = frozenset({"BUNDLE_TESTS_WITHOUT_ENGINE", "BUNDLE_TEST_HOSTILE_ROUNDS"})
# Files that tell users which variables to set.
DOCUMENTS = ("README.md", "docs/*.md", "cog.yaml", "bench/gpu.sh")


def env_name(settings_class: type[BaseSettings], name: str) -> str:
    """The variable pydantic-settings reads for field `name` (an alias, if any, wins)."""
    alias = settings_class.model_fields[name].validation_alias
    if isinstance(alias, str):
        return alias.upper()
    assert alias is None, f"{name}: alias choices would read several variables"
    return f"{settings_class.model_config['env_prefix']}{name}".upper()


def sections() -> dict[type[Section], tuple[str, ...]]:
    return {base: tuple(base.model_fields) for base in Settings.__bases__ if issubclass(base, Section)}


def test_variable_names_are_the_published_ones() -> None:
    names = {env_name(Settings, name) for name in Settings.model_fields}
    assert sorted(names - PUBLISHED) == [], "new variables: add them here and to the docs"
    assert sorted(PUBLISHED - names) == [], "variables deploys set are no longer read"


def test_every_field_has_a_description() -> None:
    missing = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert missing == []


def test_every_field_sits_in_exactly_one_section() -> None:
    grouped = sections()
    assert len(grouped) >= 8 and all(grouped.values()), grouped
    owners: dict[str, list[str]] = {}
    for section, names in grouped.items():
        for name in names:
            owners.setdefault(name, []).append(section.__name__)
    assert {name: found for name, found in owners.items() if len(found) > 1} == {}
    # A field declared on Settings itself (outside every section) is the one not owned here.
    assert set(Settings.model_fields) - set(owners) == set()


def test_durations_name_their_unit_and_milliseconds_are_the_known_two() -> None:
    fields = Settings.model_fields
    unnamed = [
        name
        for name in fields
        if any(word in name for word in DURATION_WORDS) and not name.endswith(("_s", "_ms"))
    ]
    assert unnamed == []
    assert {name for name in fields if name.endswith("_ms")} == MILLISECOND_FIELDS
    for name in MILLISECOND_FIELDS:
        assert (fields[name].description or "").startswith("Milliseconds"), name
    for name in fields:
        if name.endswith("_s"):
            assert fields[name].annotation in (float, int), name
            assert "millisecond" not in (fields[name].description or "").lower(), name


def test_sections_read_their_variables_and_validators(monkeypatch: pytest.MonkeyPatch) -> None:
    """One variable per section, and each section's own validator, read from the environment."""
    env = {
        "BUNDLE_MODEL": "org/m",
        "BUNDLE_PRESET": "none",
        "BUNDLE_SPECULATIVE_CONFIG": '{"method": "ngram"}',
        "BUNDLE_TOOL_CALL_PARSER": "hermes",
        "BUNDLE_WAKE_WAIT_S": "2.5",
        "BUNDLE_LORA_MODULES": "a=/x, b=org/y",
        "BUNDLE_KEEP_ALIVE_S": "7",
        "BUNDLE_RETRY_AFTER_S": "3",
        "BUNDLE_REDIS_URL": "",
        "BUNDLE_REDIS_WRITE_WINDOW_MS": "4",
        "BUNDLE_STREAM_COALESCE_MS": "1.5",
        "BUNDLE_ENGINE_STATS_INTERVAL_S": "0.5",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert (settings.model, settings.preset) == ("org/m", None)
    assert settings.speculative_config == {"method": "ngram"}
    assert (settings.tool_call_parser, settings.wake_wait_s) == ("hermes", 2.5)
    assert settings.lora_modules == {"a": "/x", "b": "org/y"}
    assert (settings.keep_alive_s, settings.retry_after_s, settings.redis_url) == (7, 3, None)
    assert (settings.redis_write_window_ms, settings.stream_coalesce_ms) == (4.0, 1.5)
    assert settings.engine_stats_interval_s == 0.5


def test_a_dtype_vllm_does_not_take_is_refused_when_the_settings_load(monkeypatch: pytest.MonkeyPatch) -> None:
    # Typed `str` before, "bf16" passed here and failed only in vLLM's engine start-up.
    monkeypatch.setenv("BUNDLE_DTYPE", "bf16")
    with pytest.raises(ValidationError, match="dtype"):
        Settings()
    monkeypatch.setenv("BUNDLE_DTYPE", "bfloat16")
    assert Settings().dtype == "bfloat16"


def test_deploy_env_rebuilds_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    given = Settings(
        model="org/m",
        max_num_seqs=64,
        compact_json=False,
        shutdown_grace_s=3.0,
        lora_modules={"a": "/x"},
        port=9000,
        max_n=2,
        retention_s=12.5,
        stream_coalesce_ms=2.0,
        access_log=False,
        api_key=SecretStr("not exported"),
    )
    exported = given.deploy_env()
    assert "BUNDLE_API_KEY" not in exported and set(exported) <= PUBLISHED
    for key, value in exported.items():
        monkeypatch.setenv(key, value)
    rebuilt = Settings()
    assert rebuilt.model_dump(exclude={"api_key"}) == given.model_dump(exclude={"api_key"})


def test_settings_stay_frozen_and_flat() -> None:
    settings = Settings()
    with pytest.raises(ValueError):
        settings.max_n = 3  # type: ignore[misc]
    copy = settings.model_copy(update={"max_n": 3})
    assert (copy.max_n, settings.max_n, copy.model_name) == (3, 8, "tiny")


def documented_variables() -> dict[str, set[str]]:
    """Each BUNDLE_* name in the user-facing files, with the files naming it."""
    found: dict[str, set[str]] = {}
    for pattern in DOCUMENTS:
        for path in sorted(ROOT.glob(pattern)):
            for match in re.finditer(r"BUNDLE_[A-Z0-9_]+\*?", path.read_text()):
                found.setdefault(match.group(), set()).add(str(path.relative_to(ROOT)))
    return found


def test_docs_name_only_variables_that_exist() -> None:
    known = {env_name(Settings, name) for name in Settings.model_fields}
    known |= {env_name(ModalSettings, name) for name in ModalSettings.model_fields}
    known |= TEST_ONLY_VARIABLES
    found = documented_variables()
    assert len(found) > 20  # the files were read: README alone names dozens
    unknown = {
        name: files
        for name, files in found.items()
        # `BUNDLE_MODAL_*` names a family: it must be the prefix of a real variable.
        if not (name.endswith("*") and any(k.startswith(name[:-1]) for k in known)) and name not in known
    }
    assert unknown == {}
