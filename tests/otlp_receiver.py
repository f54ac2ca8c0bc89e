"""The tests' OTLP/HTTP receiver: bench/otlp_sink.py's (the H200 stage runs the same one)."""

from bench.otlp_sink import Received, otlp_receiver

__all__ = ["Received", "otlp_receiver"]
