"""Issue #15, defect 11: a key pool's slabs counted once in /metrics (the dead-owner log that
counts key-pool blocks is tested in tests/slabs/test_slab_pooled.py)."""

from __future__ import annotations

from fineslab.router.metrics import _slab_metrics
from fineslab.slabs import TableSnapshot
from fineslab.slabs.integrity import OwnerUsage


def test_a_key_pools_slabs_are_not_counted_once_per_sharer() -> None:
    # Two runtimes sharing a 3-slab key pool each reported 3 slabs (6 for 3 slabs).
    owners = (OwnerUsage("a", 1, True, 4096, 3, 10, 2, pooled=True),
              OwnerUsage("b", 2, True, 4096, 3, 5, 2, pooled=True),
              OwnerUsage("c", 3, True, 8192, 2, 4, 0, pooled=False))
    snap = TableSnapshot(1 << 20, 8, {(4096, "PARTIAL"): 3, (8192, "FULL"): 2, (0, "FREE"): 3},
                         owners)
    families = {m.name: m for m in _slab_metrics({"cpu": snap})}
    owner = {s.labels["owner"]: s.value for s in families["fineslab_slab_owner_slabs"].samples}
    assert owner == {"a": 0, "b": 0, "c": 2}
    by_key = {s.labels["key"]: s.value for s in families["fineslab_slabs"].samples
              if s.labels["state"] != "FREE"}
    assert by_key == {"4096": 3, "8192": 2}, "the pool's slabs are counted once, by key"

