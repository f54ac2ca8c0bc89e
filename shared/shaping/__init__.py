"""OpenAI output shaping on top of the engine contract: structured-output checks, tool-call
shapers and the per-choice slow path. vLLM-free (vLLM's own tool parsers are the adapter's,
in shared/engine/vllm_tools.py)."""
