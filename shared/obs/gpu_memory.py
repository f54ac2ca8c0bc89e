"""GPU memory through NVML, read at collection time: one gauge pair per GPU the container sees.

NVIDIA's binding is imported as `pynvml` (nvidia-ml-py) where installed, else as the copy vLLM
vendors and uses itself (`vllm.third_party.pynvml`), only when vLLM is already loaded: nothing is
imported for it otherwise. Without a driver (a CPU machine) NVML fails to start and the gauges
are simply absent, as they are on vLLM's own CPU build.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterable
from types import ModuleType

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

log = logging.getLogger(__name__)


def nvml() -> ModuleType | None:
    """NVML, started; None where there is no binding or no driver."""
    names = ["pynvml"] + (["vllm.third_party.pynvml"] if "vllm" in sys.modules else [])
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        try:
            module.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            log.debug("no GPU memory gauges: NVML did not start (%s)", exc)
            return None
        return module
    return None


def watch_gpu_memory(registry: CollectorRegistry) -> bool:
    """Register the gauges when NVML works here; say whether it did."""
    module = nvml()
    if module is None:
        return False
    registry.register(GpuMemory(module))
    return True


class GpuMemory:
    def __init__(self, module: ModuleType) -> None:
        self._nvml = module

    def collect(self) -> Iterable[Metric]:
        used = GaugeMetricFamily(
            "bundle_gpu_memory_used_bytes", "GPU memory in use (all processes), by GPU.", labels=["gpu"]
        )
        total = GaugeMetricFamily("bundle_gpu_memory_total_bytes", "GPU memory, by GPU.", labels=["gpu"])
        for index in range(self._nvml.nvmlDeviceGetCount()):
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._nvml.nvmlDeviceGetHandleByIndex(index))
            used.add_metric([str(index)], float(info.used))
            total.add_metric([str(index)], float(info.total))
        return [used, total]
