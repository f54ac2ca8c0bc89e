"""What the benchmark sends: token-id prompts of a fixed length and a fixed output length."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 128
    output_tokens: int = 64
    vocab_size: int = 1000
    seed: int = 0
    model: str = "tiny"

    def prompts(self, count: int) -> list[list[int]]:
        """Fixed token-id prompts (the same for every target); ids avoid the special tokens."""
        rng = random.Random(self.seed)
        low = min(16, self.vocab_size - 1)
        return [[rng.randrange(low, self.vocab_size) for _ in range(self.prompt_tokens)] for _ in range(count)]
