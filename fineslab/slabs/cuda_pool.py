"""Loading weights straight into a CudaWeightRegion: a torch MemPool whose allocator hands out
the region's bytes (issue #16: "no second full copy" on a GPU).

On CPU the plugin moves the parameters into the region after SGLang loads them (a transient
second copy in host memory is cheap). On a GPU the arena already holds most of the device's
memory, so a model loaded beside it and then moved would need room for a second full copy that is
not there. Instead, the model is built under

    with region_pool(region) as pool:      # torch.cuda.use_mem_pool(pool.pool)
        model = build()                    # every CUDA allocation lands in the region

torch's caching allocator asks this pool's allocator for segments (2 MiB for small tensors,
20 MiB for 1-10 MiB ones, the size rounded to 2 MiB above that) and sub-allocates them; our
allocator (a first-fit list over [base, base + span) in a few lines of C, compiled once with the
system's C compiler and cached) places segments in the region. Temporaries freed during the load
are reused by torch's cache; the allocator's high-water mark (`used_bytes`) says how much of the
region the load touched, and a region smaller than the load fails it with CUDA's out-of-memory
error, naming the pool.

    base <= segment < base + span_bytes for every segment handed out
    used_bytes == max over time of the end of the highest live segment - base
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fineslab.errors import EnvironmentSetupError

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stddef.h>
#include <sys/types.h>
#include <pthread.h>

#define MAX_SEGMENTS 16384
#define ALIGN 512

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static size_t base, span, high, count;
static size_t seg_start[MAX_SEGMENTS], seg_size[MAX_SEGMENTS];  /* sorted by start */

void fineslab_pool_set(size_t region_base, size_t region_span) {
    pthread_mutex_lock(&lock);
    base = region_base; span = region_span; high = 0; count = 0;
    pthread_mutex_unlock(&lock);
}

size_t fineslab_pool_high(void) { return high; }
size_t fineslab_pool_live(void) { return count; }

void *fineslab_pool_alloc(ssize_t size, int device, void *stream) {
    (void)device; (void)stream;
    size_t want = ((size_t)size + ALIGN - 1) / ALIGN * ALIGN, at = 0, i;
    void *out = NULL;
    pthread_mutex_lock(&lock);
    for (i = 0; i <= count; i++) {          /* first fit: the gap before segment i */
        size_t end = i < count ? seg_start[i] : span;
        if (count < MAX_SEGMENTS && end >= at && end - at >= want) {
            size_t j;
            for (j = count; j > i; j--) {
                seg_start[j] = seg_start[j - 1]; seg_size[j] = seg_size[j - 1];
            }
            seg_start[i] = at; seg_size[i] = want; count++;
            if (at + want > high) high = at + want;
            out = (void *)(base + at);
            break;
        }
        if (i < count) at = seg_start[i] + seg_size[i];
    }
    pthread_mutex_unlock(&lock);
    return out;
}

void fineslab_pool_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    size_t at = (size_t)ptr - base, i;
    pthread_mutex_lock(&lock);
    for (i = 0; i < count; i++) {
        if (seg_start[i] == at) {
            for (; i + 1 < count; i++) {
                seg_start[i] = seg_start[i + 1]; seg_size[i] = seg_size[i + 1];
            }
            count--;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
}
"""


def _library() -> Path:
    """The allocator's shared library, compiled once per source (cached by its hash)."""
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fineslab"
    lib = cache / f"region_pool-{digest}.so"
    if lib.exists():
        return lib
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise EnvironmentSetupError("loading weights into the arena needs a C compiler (cc) "
                                    "to build its allocator once")
    cache.mkdir(parents=True, exist_ok=True)
    source = cache / f"region_pool-{digest}.c"
    source.write_text(_SOURCE)
    partial = lib.with_suffix(f".{os.getpid()}.partial")
    result = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial),
                             str(source), "-lpthread"], capture_output=True, text=True,
                            timeout=120, check=False)
    if result.returncode != 0:
        raise EnvironmentSetupError(f"building the arena's weight allocator failed: "
                                    f"{result.stderr.strip()[-400:]}")
    partial.replace(lib)
    return lib


class RegionPool:
    """A torch MemPool over one backed CudaWeightRegion (one per process: the allocator is a
    process-wide C library). `used_bytes` is the load's high-water mark in the region."""

    _active: RegionPool | None = None

    def __init__(self, region: Any) -> None:
        import torch

        if RegionPool._active is not None:
            raise EnvironmentSetupError("one RegionPool per process: close the other first")
        if not region.backed:
            region.back()
        path = _library()
        self._lib = ctypes.CDLL(str(path))
        self._lib.fineslab_pool_set.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
        self._lib.fineslab_pool_high.restype = ctypes.c_size_t
        self._lib.fineslab_pool_live.restype = ctypes.c_size_t
        self._lib.fineslab_pool_set(region.base, region.span_bytes)
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(path), "fineslab_pool_alloc", "fineslab_pool_free")
        self.region = region
        self.pool = torch.cuda.MemPool(allocator.allocator())
        RegionPool._active = self

    @property
    def used_bytes(self) -> int:
        return int(self._lib.fineslab_pool_high())

    @property
    def live_segments(self) -> int:
        return int(self._lib.fineslab_pool_live())

    def close(self) -> None:
        """Drop the pool (after the tensors made in it): torch hands its cached segments back
        to the allocator; then another RegionPool may be made in this process."""
        import torch

        if RegionPool._active is not self:
            return
        torch.cuda.synchronize()
        del self.pool
        torch.cuda.empty_cache()
        RegionPool._active = None


@contextlib.contextmanager
def region_pool(region: Any) -> Iterator[RegionPool]:
    """Route this thread's CUDA allocations into `region` for the `with` block (see module doc).
    The tensors made inside live in the region after it; keep the pool while they live."""
    import torch

    pool = RegionPool(region)
    with torch.cuda.use_mem_pool(pool.pool):
        yield pool
    logger.info("weights of %s loaded into the arena: %d B of its %d B region used",
                region.runtime_id, pool.used_bytes, region.span_bytes)
