"""Entry point of `python -m fineslab.slabs` (see inspector.py)."""

from __future__ import annotations

import sys

from fineslab.slabs.inspector import main

sys.exit(main())
