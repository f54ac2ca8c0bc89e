"""Compile-cache packs: what an engine start compiled, carried to the next empty container.

An engine start on a GPU spends most of its time producing files that the next start with the
same hardware, software and settings could read instead: vLLM's torch.compile artifacts and
model-class info, inductor's and Triton's kernels, FlashInfer's kernels and tuning. A platform
without memory snapshots or shared volumes (Replicate) starts every container without them.

- `layout`: the one folder those caches live in, and the environment that points them there.
- `key`: what a start's caches are valid for (GPU, versions, model, engine flags, folder).
- `manifest`: a pack's description of itself, and how two keys differ.
- `pack`: writing a pack from a folder, and checking and unpacking one into a folder.
- `fetch`: where a pack comes from (a file, a folder, a URL).
- `start`: what an engine start does with all of it; never fatal.
- `__main__`: `python -m shared.cache pack OUT.tar`, `python -m shared.cache show PACK`.

docs/cold-start.md has the design and the figures; docs/cog.md how to make and ship a pack.
"""
