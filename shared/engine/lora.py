"""LoRA adapters served beside the base model: which names exist, and loading and unloading them.

A request's `model` names the base (its served name) or a loaded adapter; anything else is a 404
`model_not_found`. The catalogue holds at most `max_loaded_loras` adapters (start-time and
runtime together). Only what cannot load is refused: a config that does not parse, a rank `r`
above `max_lora_rank` (checked here, before the engine), and weights whose target modules or
shapes do not fit the model (found by vLLM when it loads them): a 400 for an adapter loaded at
runtime, a start-up error naming BUNDLE_LORA_MODULES for one loaded at start.

An adapter's `base_model_name_or_path` is a name, not a property of its weights: fine-tunes are
made on local copies, mirrors and renamed repositories (`meta-llama/Meta-Llama-3.1-8B-Instruct`
is served as `meta-llama/Llama-3.1-8B-Instruct`). A base that is not recognisably the served
model (its id, its served name, the local folder it is served from) is therefore a logged
warning, shown on the adapter's `/v1/models` card, and never a refusal.

vLLM keeps an adapter in host memory once added (`max_cpu_loras` = the catalogue's bound), so
a request naming it never waits for a disk load, and every load error surfaces at load time,
not in the middle of a batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from shared.errors import InvalidRequest, ModelNotFound, NotFound
from shared.models.lora_sources import CONFIG_NAME, fetch_adapter
from shared.models.tiny_model import ensure_model
from shared.settings import Settings

if TYPE_CHECKING:
    from shared.obs.metrics import Metrics

log = logging.getLogger(__name__)

# Names become Prometheus label values and appear in URLs and logs: keep them plain.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][\w.\-:]{0,127}$")
COG_PREFIX = "cog-"  # names the Cog input gives the adapters it loads (see `Adapters.ensure`)


@dataclass(frozen=True)
class Adapter:
    """One adapter as the engine loads it: vLLM's LoRARequest is (name, int id, path)."""

    name: str
    lora_id: int  # never reused: a reloaded name gets a new id, so no stale engine state applies
    path: Path
    source: str  # what the operator or client gave (path, Hugging Face id, URL)
    rank: int
    base: str | None  # base_model_name_or_path, when the adapter names one
    warning: str | None = None  # why its output may be wrong here (a base named unlike the served model)

    def card_fields(self) -> dict[str, str | None]:
        """What its `/v1/models` card adds to the base's: the base it names, and any warning."""
        return {"base_model": self.base, "warning": self.warning}


class AdapterEngine(Protocol):
    """What the catalogue needs from the engine (shared/engine/vllm.py's VLLMEngine has it)."""

    async def add_adapter(self, adapter: Adapter) -> None: ...

    async def remove_adapter(self, adapter: Adapter) -> None: ...


def read_adapter_config(path: Path, source: str) -> tuple[int, str | None]:
    """(rank, base model) from a PEFT adapter's config; a 400 when it is no LoRA adapter."""

    def invalid(why: str) -> InvalidRequest:
        return InvalidRequest(f"adapter {source!r}: {why}", param="lora_path", code="invalid_lora_adapter")

    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise invalid(f"cannot read {CONFIG_NAME}: {exc}") from exc
    if not isinstance(config, dict):
        raise invalid(f"{CONFIG_NAME} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise invalid(f"peft_type is {peft_type!r}; only LoRA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise invalid(f"{CONFIG_NAME} has no positive integer rank 'r' (got {rank!r})")
    base = config.get("base_model_name_or_path")
    return rank, str(base) if base else None


# A Hugging Face cache folder of a model: .../models--<owner>--<name>/snapshots/<revision>.
_HUB_CACHE_FOLDER = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)(?:/snapshots/[^/]+)?/?$")


def served_model_names(settings: Settings) -> tuple[str, ...]:
    """Every name the served model goes by: BUNDLE_MODEL, the served name, and the local folder
    the engine loads it from (the tiny model's build folder, as
    `shared.engine.vllm_startup.resolve_model_path` gives it; a local BUNDLE_MODEL resolved)."""
    names = [settings.model, settings.model_name]
    if settings.uses_tiny_model:
        names.append(str(ensure_model(settings.cache_dir, settings.tiny_model_shape, settings.tiny_model_seed)))
    elif Path(settings.model).is_dir():
        names.append(str(Path(settings.model).resolve()))
    return tuple(dict.fromkeys(names))


def same_model(adapter_base: str, served: str) -> bool:
    """Whether the name `adapter_base` recognisably means the served model `served`: the same
    id or path (a Hugging Face cache folder read as its id, links resolved), or the same last
    part ("meta-llama/Meta-Llama-3-8B" and a copy at /models/Meta-Llama-3-8B)."""
    base_id, served_id = _model_id(adapter_base), _model_id(served)
    return base_id == served_id or base_id.rsplit("/", 1)[-1] == served_id.rsplit("/", 1)[-1]


def _model_id(name: str) -> str:
    name = name.strip().rstrip("/")
    hub = _HUB_CACHE_FOLDER.search(name)
    if hub:
        return f"{hub.group(1)}/{hub.group(2)}".lower()
    if name.startswith(("/", ".", "~")):
        name = str(Path(name).expanduser().resolve())
    return name.lower()


def base_warning(name: str, base: str | None, settings: Settings) -> str | None:
    """A warning when the adapter names a base that is not recognisably the served model."""
    if base is None or any(same_model(base, served) for served in served_model_names(settings)):
        return None
    return (
        f"adapter {name!r} names {base!r} as its base model, not the served model {settings.model!r}: "
        "it loads since its shapes fit, but its output is right only if that is the same model "
        "under another name"
    )


def prepare_adapter(name: str, source: str, lora_id: int, settings: Settings) -> Adapter:
    """Fetch and check one adapter (blocking: run it in a thread)."""
    path = fetch_adapter(source, settings.lora_dir)
    rank, base = read_adapter_config(path, source)
    if rank > settings.max_lora_rank:
        raise InvalidRequest(
            f"adapter {name!r} has rank {rank}, above this server's max_lora_rank "
            f"{settings.max_lora_rank} (BUNDLE_MAX_LORA_RANK)",
            param="lora_path",
            code="lora_rank_too_high",
        )
    return Adapter(name, lora_id, path, source, rank, base, base_warning(name, base, settings))


def _log_loaded(adapter: Adapter) -> None:
    log.info(
        "LoRA adapter %s (rank %d, id %d) loaded from %s",
        adapter.name,
        adapter.rank,
        adapter.lora_id,
        adapter.source,
    )
    if adapter.warning:
        log.warning("%s", adapter.warning)


def check_name(name: str, settings: Settings) -> None:
    if not ADAPTER_NAME.match(name):
        raise InvalidRequest(
            f"adapter name {name[:64]!r}: use 1-128 letters, digits, '.', '_', '-' or ':'",
            param="lora_name",
        )
    if name == settings.model_name:
        raise InvalidRequest(f"{name!r} is the base model's name", param="lora_name")


async def load_static(settings: Settings, engine: AdapterEngine) -> list[Adapter]:
    """The adapters of BUNDLE_LORA_MODULES, fetched, checked and loaded: a bad one fails the start."""
    if len(settings.lora_modules) > settings.max_loaded_loras:
        raise InvalidRequest(
            f"BUNDLE_LORA_MODULES names {len(settings.lora_modules)} adapters; "
            f"BUNDLE_MAX_LOADED_LORAS is {settings.max_loaded_loras}"
        )
    loaded = []
    for lora_id, (name, source) in enumerate(settings.lora_modules.items(), start=1):
        try:
            check_name(name, settings)
            adapter = await asyncio.to_thread(prepare_adapter, name, source, lora_id, settings)
            await engine.add_adapter(adapter)
        except InvalidRequest as exc:  # the operator's error: say where it came from
            raise InvalidRequest(
                f"BUNDLE_LORA_MODULES: {name}={source}: {exc.message}", param=exc.param, code=exc.code
            ) from exc
        _log_loaded(adapter)
        loaded.append(adapter)
    return loaded


class Adapters:
    """The loaded adapters by name; the one place that loads or unloads them at runtime."""

    def __init__(
        self, settings: Settings, engine: AdapterEngine, metrics: Metrics, loaded: Iterable[Adapter] = ()
    ) -> None:
        self.settings = settings
        self._engine = engine
        self._metrics = metrics
        self._by_name = {adapter.name: adapter for adapter in loaded}
        self._static = frozenset(self._by_name)
        self._next_id = max((a.lora_id for a in self._by_name.values()), default=0) + 1
        self._last_used: dict[str, float] = dict.fromkeys(self._by_name, time.monotonic())
        self._lock = asyncio.Lock()  # loads are rare and slow: one at a time keeps the bound exact

    def resolve(self, model: str) -> Adapter | None:
        """None for the base model, the adapter for an adapter's name; 404 otherwise."""
        if model == self.settings.model_name:
            return None
        adapter = self._by_name.get(model)
        if adapter is None:
            served = ", ".join([repr(self.settings.model_name), *map(repr, sorted(self._by_name))])
            raise ModelNotFound(
                f"The model {model!r} does not exist; this server serves {served}", param="model"
            )
        self._last_used[model] = time.monotonic()
        return adapter

    def holds(self, adapter: Adapter) -> bool:
        return self._by_name.get(adapter.name) is adapter

    def loaded(self) -> list[Adapter]:
        return sorted(self._by_name.values(), key=lambda adapter: adapter.lora_id)

    async def load(self, name: str, source: str) -> Adapter:
        """Fetch, check and load an adapter under `name` (400 when anything is wrong)."""
        self._check_runtime()
        check_name(name, self.settings)
        async with self._lock:
            if name in self._by_name:
                raise InvalidRequest(f"the LoRA adapter {name!r} is already loaded", param="lora_name")
            if len(self._by_name) >= self.settings.max_loaded_loras:
                raise InvalidRequest(
                    f"{len(self._by_name)} adapters are loaded, the most this server holds "
                    "(BUNDLE_MAX_LOADED_LORAS); unload one first",
                    param="lora_name",
                    code="lora_limit_reached",
                )
            return await self._load_locked(name, source)

    async def _load_locked(self, name: str, source: str) -> Adapter:
        lora_id, self._next_id = self._next_id, self._next_id + 1
        adapter = await asyncio.to_thread(prepare_adapter, name, source, lora_id, self.settings)
        await self._engine.add_adapter(adapter)
        self._by_name[name] = adapter
        self._last_used[name] = time.monotonic()
        _log_loaded(adapter)
        return adapter

    async def unload(self, name: str) -> Adapter:
        """Forget `name` at once (new requests naming it get 404); the engine drops it when its
        running requests have ended (shared/engine/vllm.py)."""
        self._check_runtime()
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise NotFound(
                f"no LoRA adapter named {name!r} is loaded", param="lora_name", code="lora_not_found"
            )
        self._last_used.pop(name, None)
        self._metrics.forget_model(name)
        await self._engine.remove_adapter(adapter)
        log.info("LoRA adapter %s unloaded", name)
        return adapter

    async def ensure(self, source: str) -> str:
        """The model name for `source` (Cog's adapter input): a loaded adapter's name, or the
        source loaded now under a name derived from it, making room by unloading the adapter
        used least recently (never a start-time one) when the catalogue is full."""
        source = source.strip()
        if source in self._by_name:
            return source
        name = COG_PREFIX + hashlib.sha256(source.encode()).hexdigest()[:16]
        self._check_runtime()
        async with self._lock:
            if name not in self._by_name:
                await self._make_room()
                await self._load_locked(name, source)
        return name

    async def _make_room(self) -> None:
        if len(self._by_name) < self.settings.max_loaded_loras:
            return
        evictable = [name for name in self._by_name if name not in self._static]
        if not evictable:
            raise InvalidRequest(
                "every adapter slot holds a start-time adapter (BUNDLE_MAX_LOADED_LORAS)",
                code="lora_limit_reached",
            )
        oldest = min(evictable, key=lambda name: self._last_used.get(name, 0.0))
        await self.unload(oldest)

    def _check_runtime(self) -> None:
        if not self.settings.enable_lora:
            raise InvalidRequest(
                "LoRA is not enabled on this server (BUNDLE_ENABLE_LORA)", code="lora_disabled"
            )
        if not self.settings.lora_runtime_loading:
            raise InvalidRequest(
                "runtime adapter loading is off on this server (BUNDLE_LORA_RUNTIME_LOADING)",
                code="lora_runtime_loading_disabled",
            )
