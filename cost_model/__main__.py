"""Entry point for ``python -m cost_model``."""

import sys

from cost_model.cli import main

sys.exit(main())
