"""Honest serving-cost model: per-second, per-request, per-token and reserved billing.

Run ``python -m cost_model estimate --help`` for the command-line tool.
"""

from cost_model.errors import CostModelError

__all__ = ["CostModelError"]
