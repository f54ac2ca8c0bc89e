"""`EngineSide`: what running a generation on this replica's engine needs, shared by the starter
of new generations (shared/starter.py) and the continuation of taken-over ones."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass

from shared.engine.contract import Engine
from shared.engine.lora import Adapters
from shared.generation.pacing import StreamPacing
from shared.obs.metrics import Metrics
from shared.settings import Settings


@dataclass(frozen=True)
class EngineSide:
    settings: Settings
    engine: Engine
    metrics: Metrics
    adapters: Adapters
    pacing: StreamPacing
    tokenizer_thread: Executor  # the one thread a Hugging Face tokenizer may be called from
