"""CudaWeightRegion: a runtime's weights in whole slabs of a CUDA arena, at fixed addresses.

The CPU `WeightRegion` (weights.py) maps slabs of the arena file under a reserved range with
mmap; this is the same region over CUDA virtual memory (cuda_vmm.py): the range is a
cuMemAddressReserve, backing slab s at position i is a cuMemMap of slab s's own physical
allocation, covering is a cuMemUnmap. Everything else (which slabs, the slab table's
`<runtime>:w` owner, lend / reclaim / alias for the layer streamer) is WeightRegion's own code.

    mapped positions == backed positions minus lent ones plus aliased ones
    a covered position is unmapped: a kernel touching it faults (and ends the CUDA context)

Ordering: a map or unmap takes effect at once for the device, not in stream order. The caller
covers a position only when no queued kernel reads it (the streamer changes its lent set between
forward passes, after a synchronize), exactly as the CPU region's callers do.

Cost: one cuMemMap + cuMemSetAccess per slab (tens of microseconds), no copy, no allocation.
"""

from __future__ import annotations

from typing import Any

from fineslab.slabs.cuda_vmm import VmmBacking, driver, tensor_at
from fineslab.slabs.table import SlabTable
from fineslab.slabs.weights import WeightRegion


class CudaWeightRegion(WeightRegion):
    """`nbytes` of weights of `runtime_id` in whole slabs of the CUDA arena `backing`."""

    def __init__(self, table: SlabTable, backing: VmmBacking, runtime_id: str,
                 nbytes: int) -> None:
        drv = driver()
        grain = drv.granularity(backing.ordinal)
        backing.physical_of(0, table.dims.slab_bytes)  # ConfigError unless slab by slab
        self._setup(table, runtime_id, nbytes, grain, "the CUDA mapping granularity")
        self.backing = backing
        self._mapped: set[int] = set()
        self.base = drv.reserve(self.span_bytes, grain)

    def _map_slab(self, position: int, slab: int) -> None:
        if position in self._mapped:  # aliasing over a mapped position: unmap it first
            self._unmap(position)
        driver().map(self.base + position * self.slab_bytes, self.slab_bytes,
                     self.backing.physical_of(slab, self.slab_bytes), self.backing.ordinal)
        self._mapped.add(position)

    def _unmap(self, position: int) -> None:
        driver().unmap(self.base + position * self.slab_bytes, self.slab_bytes)
        self._mapped.discard(position)

    def _cover(self, first: int = 0, count: int | None = None) -> None:
        import torch

        count = self.num_slabs - first if count is None else count
        doomed = [p for p in range(first, first + count) if p in self._mapped]
        if doomed:
            torch.cuda.synchronize(self.backing.ordinal)  # no queued kernel may still read them
        for position in doomed:
            self._unmap(position)

    def tensor(self) -> Any:
        """A uint8 torch tensor over the whole range (valid while backed; never moves)."""
        return tensor_at(self.base, self.nbytes, self.backing.ordinal)

    def _close_backing(self) -> None:
        # Unmapped by unback(); the range itself stays reserved (tensors built over it may
        # outlive the region and must fault, not read reused memory), as on CPU.
        return
