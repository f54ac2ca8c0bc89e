"""Random-weight LoRA adapters in PEFT's format, for a model's config.json (tests and the benchmark).

PEFT itself is not needed: an adapter is `adapter_config.json` plus `adapter_model.safetensors`
with, per layer and target module, `lora_A` (rank x in) and `lora_B` (out x rank). PEFT starts
`lora_B` at zero (a fresh adapter changes nothing); here both are random, so an adapter's tokens
differ from the base model's, and from another adapter's (another seed).
"""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "v_proj")
WEIGHT_SCALE = 0.1  # large enough to change greedy tokens of the random tiny model, measured


def module_shapes(config: dict, module: str) -> tuple[int, int]:
    """(in, out) features of one attention projection of a Llama-style config."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
    }[module]


def model_config(model_dir: Path) -> dict:
    return dict(json.loads((model_dir / "config.json").read_text()))


def write_adapter(
    out: Path,
    model: Path | dict,
    *,
    rank: int = 8,
    seed: int = 0,
    targets: tuple[str, ...] = TARGETS,
    base: str | None = "tiny",
    dtype: str = "float32",
    widen_by: int = 0,
    scale: float = WEIGHT_SCALE,
) -> Path:
    """Write a random adapter for `model` (its directory, or its config as a dict) into `out`
    and return `out`. `scale` 0 writes an adapter that changes nothing (all zeros).
    `widen_by` > 0 makes every lora_A that much wider than the model's layers: an adapter
    whose shapes do not fit (another model's), for error tests."""
    import torch
    from safetensors.torch import save_file

    config = model if isinstance(model, dict) else model_config(model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in targets:
            features_in, features_out = module_shapes(config, module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, features_in + widen_by, generator=generator) * scale
            b = torch.randn(features_out, rank, generator=generator) * scale
            tensors[f"{prefix}.lora_A.weight"] = a.to(getattr(torch, dtype)).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(getattr(torch, dtype)).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,  # scaling alpha / r = 1: the random weights act as written
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": list(targets),
        "base_model_name_or_path": base,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out
