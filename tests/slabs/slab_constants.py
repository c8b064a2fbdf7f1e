"""Tiny formats, and a dead pid, shared by the slab tests.

A module of its own, not conftest.py: worker processes spawned by the stress test re-import the
test module, and there `conftest` resolves to tests/conftest.py, not this folder's.
"""

from __future__ import annotations

import subprocess
import sys

from fineslab.slabs.formats import BlockFormat, KVDtype, KVShape

#: Two formats whose block strides divide an 8-block slab of A: A = 512 B, B = 1,024 B.
FMT_A = BlockFormat.unpadded(KVShape("a", 2, 2, 8, KVDtype.BF16), 4)
FMT_B = BlockFormat(KVShape("b", 2, 2, 8, KVDtype.INT4), 4, 256)
SLAB_BYTES = 8 * FMT_A.block_stride_bytes
NUM_SLABS = 6


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (a dead runtime's identity)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
