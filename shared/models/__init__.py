"""Model files: fetching weights and LoRA adapters, and building the random-weight test models.

Blocking disk and network work with no engine in it; the engine (shared/engine/) loads what
these modules leave on disk."""
