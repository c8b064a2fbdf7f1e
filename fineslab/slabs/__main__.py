"""Entry point of `python -m fineslab.slabs` (see inspector.py)."""

from __future__ import annotations

import sys

from fineslab.slabs.inspector import main

if __name__ == "__main__":
    sys.exit(main())
