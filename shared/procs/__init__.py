"""Several API processes on one engine core (BUNDLE_API_PROCESSES > 1); see supervisor.py."""
