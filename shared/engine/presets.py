"""Named deploy presets (`BUNDLE_PRESET`): engine knobs chosen for one goal, with the reason.

A preset fills only the engine fields the user did NOT set (`Settings.model_fields_set`), so
`BUNDLE_PRESET=throughput BUNDLE_MAX_NUM_SEQS=64` runs the throughput preset with 64 sequences.
Unset: no preset, vLLM's and the bundle's own defaults.

The figures behind each choice are H200 measurements (Llama-3-8B shape, dummy weights, vLLM
0.26.0; results/h200/ and the README's tables): the issue-16 runs that prompted them, and
`bash bench/gpu.sh presets`, which compares each preset with `vllm serve` defaults.
"""

from __future__ import annotations

from typing import Any

from shared.settings import Settings

PRESETS: dict[str, dict[str, Any]] = {
    # Most tokens per GPU-second, for batch and busy endpoints.
    # - quantization fp8: weights are read once per decode step, so halving their bytes is the
    #   largest lever: one stream 287 tok/s against 203 in bf16 (3.44 ms/token, below bf16's
    #   weight-read floor), and about 12,400 tok/s against 9,500 at 256 streams (first wave).
    #   Checkpoints already in FP8 (the Modal default model) keep their own scales.
    # - max_num_batched_tokens 8192, the serving default on an H100/H200, set explicitly: 16,384
    #   (tried first) prefilled a wave of new requests in half the steps, but each such step
    #   stalled every running stream longer: inter-token p99 at 256 streams 233 ms against
    #   `vllm serve`'s 195 (2026-11-30, results/h200/presets/ of that date, in git history).
    # - max_num_seqs stays 256: the KV cache of an 8B model at 768 tokens per stream holds far
    #   more, but Modal's per-container concurrency is derived from it (modal_app/settings.py).
    # - kv cache dtype stays auto: an FP8 KV cache without calibrated scales changes outputs.
    "throughput": {"quantization": "fp8", "max_num_batched_tokens": 8192},
    # Lowest time to first token and steadiest inter-token latency, for chat.
    # - fp8 as above: per-token time is weight reads, so it is also the latency lever.
    # - max_num_batched_tokens 2048: a step never prefills more than 2,048 tokens, so running
    #   streams are stalled less by arriving prompts (at 256 streams with 8,192, inter-token p99
    #   reached ~200 ms on every target). Figure: `gpu.sh presets` (to fill).
    # - max_num_seqs 64: a smaller batch decodes each step faster (7,000 tok/s over 64 streams is
    #   ~110 tok/s each; 256 streams gave ~43 each), and fewer CUDA graphs are captured at start.
    "latency": {"quantization": "fp8", "max_num_batched_tokens": 2048, "max_num_seqs": 64},
    # Shortest cold start, for scale-to-zero endpoints with rare requests: no torch.compile and
    # no CUDA graph capture. Measured: first token 46 s after start against 97 s with an empty
    # compile cache (38 s warm), but one stream then decodes at 62 tok/s instead of 203.
    "fast-boot": {"enforce_eager": True},
}


# No preset sets BUNDLE_API_PROCESSES (several API processes on one engine core, shared/procs/);
# choose it by model size. Measured on the H200 (vLLM 0.26.0 GPU build, 2026-12-02,
# results/h200/procs-1b and procs-8b):
# - about 1B (Llama-3.2-1B shape): 4. With 4, 1.06 / 1.18x raw's tok/s at 256 / 512 streams,
#   where one process was the ceiling at 0.80 / 0.71x;
# - between 1B and 8B: not measured;
# - 8B: 1. Four gave 1.00x of one at 1, 64 and 256 streams: no gain, and more CPU per token;
# - larger: one (not measured): fewer tokens per second per GPU, less work for the API process.
# docs/performance.md, "Which N for which model", keeps the same table.

# Knobs a preset sets only on a GPU. vLLM's CPU build refuses FP8 for float32 models, and the
# local test model is float32 on purpose (see shared/engine/vllm_startup.py, _dtype): the Modal app, run
# locally on CPU by the tests, must start with its default preset. An explicit setting applies
# everywhere, as always.
GPU_ONLY = frozenset({"quantization"})


def apply_preset(settings: Settings, on_cpu: bool = False) -> Settings:
    """`settings` with its preset's knobs filled in where the user set nothing explicitly."""
    if settings.preset is None:
        return settings
    knobs = PRESETS[settings.preset]
    chosen = {
        name: value
        for name, value in knobs.items()
        if name not in settings.model_fields_set and not (on_cpu and name in GPU_ONLY)
    }
    return settings.model_copy(update=chosen)
