"""A small JSON file that readers in other processes poll: written whole, never seen half-written.

`write_json_whole` writes the document to `<name>.partial` beside it and renames that into
place (a rename within one folder is atomic), so a reader finds the old document or the new one.
The run record, a node fleet's files, a runtime's stream state and its step scales use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_whole(path: Path, doc: object) -> None:
    """Write `doc` as JSON to `path` whole (module doc)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc))
    os.replace(partial, path)
