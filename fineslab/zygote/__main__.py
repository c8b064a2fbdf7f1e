"""Entry point of `python -m fineslab.zygote` (started by fineslab itself; see server.py)."""

from __future__ import annotations

import sys

from fineslab.zygote.server import main

if __name__ == "__main__":
    sys.exit(main())
