"""The engine: its contract with the API (`shared.engine.contract`), the vLLM implementation
(`shared.engine.vllm`, with its feature checks and tool parsers) and its start-up
(`shared.engine.vllm_startup`), presets, LoRA adapters and the engine's stats file."""
