"""Builds the local test model: a small Llama with random weights and a BPE tokenizer.

Nothing can be downloaded here, and the point of the local model is to exercise the REAL vLLM
engine (scheduler, KV cache, detokenizer, sampling) on a laptop or CI box. Its output is
gibberish by construction. The build is deterministic for a seed and cached on disk, so it runs
once per machine (a few MB, a few seconds).

``llama3-8b``, ``llama3-1b`` and ``llama3-70b`` write only a config with Llama-3-8B's
(Llama-3.2-1B's, Llama-3-70B's) shape plus a tokenizer covering all 128,256 ids; vLLM's
``load_format="dummy"`` then fills random weights, giving the real model's compute and memory
cost on a GPU without its weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy: imported for real inside the functions that build
    from transformers import LlamaConfig, PreTrainedTokenizerFast

BUILDER_VERSION = 3  # bump when the output changes, so caches rebuild

# Tools are rendered the way Llama 3.1 Instruct's template does (a JSON description of each
# function; calls written as {"name": ..., "parameters": ...}), so the deploy default tool parser
# (`llama3_json`) reads the tiny model's calls too and the tool tests exercise the real parser.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>{{ '\\n' }}"
    'To call a function, answer with only {"name": function name, "parameters": arguments}.'
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ '\\n' }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{{ {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}"
    "{% if not loop.last %}; {% endif %}"
    "{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# <|python_tag|> is Llama 3.1's tool-call marker: vLLM's llama3_json parser requires the token.
SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|python_tag|>",
]


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    torch_dtype: str
    tie_word_embeddings: bool = False  # Llama-3.2-1B reads its output projection from the embeddings


SHAPES: dict[str, ModelShape] = {
    # float32 on purpose: vLLM's CPU build in bf16 dies under coglet on AMX machines, and one
    # dtype everywhere keeps local runs comparable.
    # head_dim 64: the CPU attention kernels reject small head sizes such as 16.
    "tiny": ModelShape(128, 256, 2, 2, 1, 1024, 2048, 10000.0, "float32"),
    "llama3-8b": ModelShape(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0, "bfloat16"),
    # Llama-3.2-1B: the size where one API process is the ceiling (issue 39). Its own context is
    # 131,072 with llama3 rope scaling; 8,192 unscaled as for the 8B shape, which changes neither
    # the compute nor the memory of the benchmark's 768-token sequences.
    "llama3-1b": ModelShape(
        2048, 8192, 16, 32, 8, 128256, 8192, 500000.0, "bfloat16", tie_word_embeddings=True
    ),
    # Llama-3-70B: 70.6 B parameters, 141 GB in bf16, which leaves one H200 (150.7 GB) next to no
    # room for a KV cache: two, with tensor parallel 2, ~70.6 GB of weights on each (issue 41,
    # `bash bench/gpu.sh tp2`). Context 8,192, the model's own.
    "llama3-70b": ModelShape(8192, 28672, 80, 64, 8, 128256, 8192, 500000.0, "bfloat16"),
}


def model_dir(cache_dir: Path, shape: str = "tiny", seed: int = 0) -> Path:
    """Where `ensure_model` keeps this model, built or not."""
    return cache_dir / f"{shape}-seed{seed}-v{BUILDER_VERSION}"


def ensure_model(cache_dir: Path, shape: str = "tiny", seed: int = 0) -> Path:
    """Return the directory of the built model, building it first if it is not cached."""
    target = model_dir(cache_dir, shape, seed)
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build in a scratch dir and rename: concurrent builders (pytest workers, a server and a
    # test) never see a half-written model.
    scratch = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=cache_dir))
    try:
        _build(scratch, SHAPES[shape], shape, seed)
        os.replace(scratch, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _build(out: Path, shape: ModelShape, name: str, seed: int) -> None:
    if name == "tiny":
        tokenizer = _train_bpe_tokenizer(shape.vocab_size)
        _write_weights(out, shape, tokenizer, seed)
    else:
        tokenizer = _wordlevel_tokenizer(shape.vocab_size)
        _write_config(out, shape, tokenizer)
    tokenizer.save_pretrained(out)


def _corpus() -> list[str]:
    text = (Path(__file__).parent / "tiny_corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _wrap(tokenizer_object: object) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
    )


def _train_bpe_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return _wrap(tokenizer)


def _wordlevel_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A vocabulary covering every id: random weights may sample any of them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for index in range(len(SPECIAL_TOKENS), vocab_size):
        vocab[f"w{index}"] = index
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return _wrap(tokenizer)


def _llama_config(shape: ModelShape, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    from transformers import LlamaConfig

    fields = asdict(shape)
    dtype = fields.pop("torch_dtype")
    return LlamaConfig(
        **fields,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # transformers 5 names it `dtype` and no longer declares `torch_dtype`, but still takes it
        # (and writes `dtype`); `torch_dtype` is the one spelling every supported release
        # (>=4.45) reads, and the GPU image's transformers need not be 5.
        torch_dtype=dtype,  # type: ignore[call-arg]
    )


def _write_config(out: Path, shape: ModelShape, tokenizer: PreTrainedTokenizerFast) -> None:
    config = _llama_config(shape, tokenizer)
    # A config saved without a model names no class; the real checkpoints' configs do, and the
    # start reads it: without it vLLM falls back to transformers' base `LlamaModel` name (the same
    # class underneath) and the early inspection (shared/engine/model_inspection.py) has no name
    # to inspect, so the H200 cold boots until 2026-12-03 paid vLLM's own inspection.
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    generation = {"bos_token_id": 1, "eos_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(generation))


def _write_weights(out: Path, shape: ModelShape, tokenizer: PreTrainedTokenizerFast, seed: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    # transformers decorates `to` with functools.wraps(torch.nn.Module.to), which mypy reads as
    # the unbound function (the dtype taken for `self`).
    model = LlamaForCausalLM(_llama_config(shape, tokenizer)).to(torch.float32)  # type: ignore[arg-type]
    model.save_pretrained(out, safe_serialization=True)
