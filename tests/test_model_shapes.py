"""Llama-3-70B's shape for the two-GPU stage (issue 41, `bash bench/gpu.sh tp2`): the config vLLM
reads, and tensor parallel 2 reaching vLLM's own server as it reaches the bundle's engine."""

from __future__ import annotations

from pathlib import Path

import orjson

from shared.models.tiny_model import ensure_model
from shared.settings import Settings


def test_the_70b_shape_is_llama_3_70bs_config_only(tmp_path: Path) -> None:
    built = ensure_model(tmp_path, "llama3-70b")
    config = orjson.loads((built / "config.json").read_bytes())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    assert {key: config[key] for key in (*keys, "num_key_value_heads")} == {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    }
    rope_theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]  # transformers 5
    assert (config["vocab_size"], rope_theta) == (128256, 500000.0)
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert config["tie_word_embeddings"] is False
    assert config["architectures"] == ["LlamaForCausalLM"]  # as the real checkpoint's config says
    assert not list(built.glob("*.safetensors"))  # vLLM's dummy load fills the weights
    assert Settings(tiny_model_shape="llama3-70b").tiny_model_shape == "llama3-70b"

    # 70.6 B parameters, 141 GB in bf16: over the 128 GB that the stages' share (0.85) of one H200
    # gives vLLM; split over two, ~70.6 GB each leaves room for the KV cache of 256 streams of 768
    # tokens (bench/gpu.sh, the tp2 block, has the arithmetic).
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head = hidden // config["num_attention_heads"]
    kv = head * config["num_key_value_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner + 2 * hidden
    parameters = layers * per_layer + 2 * config["vocab_size"] * hidden + hidden
    assert 70.5e9 < parameters < 70.6e9
    share = 0.85 * 143771 * 2**20  # bytes of one H200 (nvidia-smi's 143,771 MiB) vLLM may use
    weights = 2 * parameters
    assert weights > share
    kv_per_token = layers * kv // 2 * 2 * 2  # per GPU: half the KV heads, K and V, 2 bytes each
    activations = 4 * 2**30  # what vLLM's profiling run takes, generously
    assert (share - weights / 2 - activations) / kv_per_token > 1.5 * 256 * (512 + 256)


def test_tensor_parallel_reaches_vllms_own_server() -> None:
    from bench.servers import vllm_defaults_command, vllm_server_command

    one = Settings(enforce_eager=True, max_model_len=512)
    two = one.model_copy(update={"tensor_parallel_size": 2})
    for command in (vllm_server_command(two, 8123), vllm_defaults_command(two, 8123)):
        flag = command.index("--tensor-parallel-size")
        assert command[flag + 1] == "2"
    assert "--tensor-parallel-size" not in vllm_server_command(one, 8123)
