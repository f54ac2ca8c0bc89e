"""Observability: Prometheus metrics, event-loop lag, the engine's output timings."""
