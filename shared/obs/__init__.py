"""Observability: Prometheus metrics (summed across API processes), event-loop lag, the engine's
output timings, garbage-collection pauses, and what a slow shutdown still waits for."""
