"""Where an engine start finds what earlier starts compiled: one root for all of it.

vLLM keeps its torch.compile artifacts, model-architecture info and FlashInfer tuning under
`VLLM_CACHE_ROOT`, but torch's inductor and Triton keep their kernels in folders of their own
(/tmp and ~/.triton by default), which a new container does not have. On the H200, a start with
all of them empty spent ~17 s more at the end of vLLM's init than a warm one (after the CUDA
graphs, before "JIT monitor activated"; results/h200/startup/); Triton's cache was not
isolated from the others there. So every deploy that keeps a cache between containers keeps all
of them together (FlashInfer's kernels too), and the start-up benchmark's "warm" path is exactly
that layout. The layout itself is the core's (shared/cache/layout.py); the bundle's settings are
told the root as well (BUNDLE_COMPILE_CACHE_DIR), so that a compile-cache pack given to a
container (BUNDLE_COMPILE_CACHE) unpacks into it: how a new volume can be seeded.
"""

from __future__ import annotations

from shared.cache.layout import cache_env


def compile_cache_env(root: str) -> dict[str, str]:
    """The environment that puts vLLM's, inductor's, Triton's and FlashInfer's caches under
    `root`, and tells the bundle that `root` is where they are."""
    return {**cache_env(root), "BUNDLE_COMPILE_CACHE_DIR": root}
