"""The single exception type for bad input, so the CLI can turn it into one line."""


class CostModelError(ValueError):
    """Raised for any invalid user input: rates, catalogue files, benchmark files, flags."""
