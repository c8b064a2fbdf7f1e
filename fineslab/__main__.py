"""`python -m fineslab`: the `fineslab` console script (fineslab/cli.py)."""

from __future__ import annotations

import sys

from fineslab.cli import main

if __name__ == "__main__":
    sys.exit(main())
