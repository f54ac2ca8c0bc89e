"""The engine: its contract with the API (`shared.engine.contract`), the vLLM implementation
(`shared.engine.vllm`) and what it needs: presets, tool calls and structured output, choices,
LoRA adapters, weights, the tiny test model."""
