"""What the benchmark sends: token-id prompts of a fixed length, and a fixed output length or
one drawn per request around it (`output_spread`).

Every request of a suite gets its own prompt, and every target gets the same ones. vLLM's
prefix cache is on by default: a prompt sent twice skips its prefill the second time (on the
H200, two identical 256-stream waves through the bundle gave 9,525 then 15,398 tok/s). So the
prompts of a batch are a pure function of (suite seed, batch name), where the name says which
level, repeat or warm-up the batch is for: target A's level-64 repeat-2 prompts are target B's,
and no two batches of one target's run share a prompt.

The shared-prefix workload is the opposite on purpose: one long common prefix (a system prompt)
before a short unique suffix, to show what prefix caching buys when it can hit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ID = 16  # ids below this are the tiny model's special tokens; real vocabularies too


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 128
    output_tokens: int = 64
    vocab_size: int = 1000
    seed: int = 0
    model: str = "tiny"
    # Tokens of a prefix common to every prompt (0: none). `prompt_tokens` is then the unique
    # suffix after it.
    shared_prefix_tokens: int = 0
    # None: a closed loop (a level's `concurrency` requests at once, then one each time one
    # ends). A number: an open loop, requests starting as a Poisson process at this many per
    # second, a level's concurrency only a cap (as `vllm bench serve --request-rate`): arrivals
    # do not wait for completions, so a target's speed cannot shift when the next one comes.
    request_rate: float | None = None
    # Seconds a client waits after a response ends before sending its next request (a user's
    # think time; 0: at once). With `think_random`, each request's wait is drawn from an
    # exponential distribution of that mean instead. A diagnostic: the in-process raw target's
    # next request waits for its busy event loop (a median 16-29 ms at 256 streams on the
    # H200), an HTTP client's does not, and a fixed wait keeps finishing groups in step where
    # real clients' varied ones would not.
    think_s: float = 0.0
    think_random: bool = False
    # Each request's output length drawn uniformly within this share either side of
    # `output_tokens` (0: every request the same length). With one length, a closed loop's
    # requests prefilled in one engine step also end in one, and their replacements go round
    # together as a clump: TTFT then comes in whole prefill steps (at 256 streams on the H200
    # a run's p50 was ~600 or ~790 ms, nothing between). Varied lengths break the clumps up.
    output_spread: float = 0.0
    # Models the requests name in turn (LoRA adapters, bench/lora.py); empty: `model` for all.
    models: tuple[str, ...] = ()

    def prompts(self, count: int, batch: str) -> list[list[int]]:
        """`count` prompts for the batch called `batch` (e.g. "c64/r2"): the same ids for every
        target, different from every other batch's."""
        # A string seed is hashed with SHA-512, so it is stable across processes and runs.
        rng = random.Random(f"{self.seed}/{batch}")
        prefix = self.shared_prefix()
        return [prefix + self._ids(rng, self.prompt_tokens) for _ in range(count)]

    def shared_prefix(self) -> list[int]:
        """The common prefix (the same in every batch), empty when the workload has none."""
        return self._ids(random.Random(f"{self.seed}/shared-prefix"), self.shared_prefix_tokens)

    def arrival_offsets(self, prompts: list[list[int]]) -> list[float] | None:
        """Seconds from a level's start at which each of `prompts` is sent (open loop), or None
        (closed loop). Seeded by the batch's own prompts: every target gets the same schedule."""
        if self.request_rate is None:
            return None
        rng = random.Random(f"{self.seed}/arrivals/{len(prompts)}/{prompts[0][:8] if prompts else []}")
        offsets, at = [], 0.0
        for _ in prompts:
            offsets.append(at)
            at += rng.expovariate(self.request_rate)
        return offsets

    def think_times(self, prompts: list[list[int]]) -> list[float] | None:
        """Seconds each request's client waits after it ends (None: no waiting). Random ones are
        seeded by each request's own prompt (its unique end, not a shared prefix): every target
        gets the same waits."""
        if not self.think_s:
            return None
        if not self.think_random:
            return [self.think_s] * len(prompts)
        return [
            random.Random(f"{self.seed}/think/{prompt[-8:]}").expovariate(1 / self.think_s)
            for prompt in prompts
        ]

    def output_length(self, prompt: list[int]) -> int:
        """Tokens to generate for this prompt: `output_tokens`, or with `output_spread` a length
        seeded by the prompt's unique end, so every target generates the same lengths."""
        if not self.output_spread:
            return self.output_tokens
        low = max(1, round(self.output_tokens * (1 - self.output_spread)))
        high = max(low, round(self.output_tokens * (1 + self.output_spread)))
        return random.Random(f"{self.seed}/output/{prompt[-8:]}").randint(low, high)

    @property
    def total_prompt_tokens(self) -> int:
        return self.shared_prefix_tokens + self.prompt_tokens

    def _ids(self, rng: random.Random, length: int) -> list[int]:
        low = min(FIRST_ID, self.vocab_size - 1)
        return [rng.randrange(low, self.vocab_size) for _ in range(length)]
