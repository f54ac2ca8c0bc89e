"""Observability: Prometheus metrics (summed across API processes), event-loop lag, the engine's
output timings, garbage-collection pauses, what a slow shutdown still waits for, and the record
of the start checks of uvicorn's, Starlette's and coglet's internals."""
