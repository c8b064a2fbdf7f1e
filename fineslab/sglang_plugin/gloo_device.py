"""One gloo device for all of a process's single-rank gloo groups.

SGLang builds a gloo process group for each of its group coordinators (world, tensor, pipeline,
expert and attention parallel groups, a CPU group beside each device group): nine in a tp=1
runtime's scheduler, on CPU and on GPU alike. torch gives each group a device of its own, and
each device a loop thread that wakes every 10 ms (gloo's epoll timeout) and two worker threads:
an idle runtime's scheduler held 27 gloo threads, its nine loops about 2% of a core. A group of
one rank never sends a byte; here such groups share one device (one loop thread) and keep one
worker thread each. Groups of several ranks are built exactly as torch builds them.

How: `torch.distributed.distributed_c10d.ProcessGroupGloo`, the name torch's group factory
calls, is replaced by a stand-in class that builds the real `ProcessGroupGloo` with options
naming the shared device for a single-rank group and answers `isinstance` and attribute
lookups as the real class (torch checks both). The device is made in the process that first
builds such a group (a device's thread does not survive a fork). Where torch lacks what this
needs (`ProcessGroupGloo._Options`, `create_default_device`), nothing is replaced.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

#: (pid, device): the shared device of the process that made it.
_device: tuple[int, Any] | None = None


def _shared_device(real: Any) -> Any:
    global _device
    if _device is None or _device[0] != os.getpid():
        _device = (os.getpid(), real.create_default_device())
    return _device[1]


class _StandIn(type):
    """Metaclass of the stand-in: calls build real groups; checks and lookups go to the real
    class."""

    real: Any

    def __call__(cls, store: Any, rank: int, size: int, *args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        if size != 1 or args or set(kwargs) != {"timeout"} or timeout is None:
            return cls.real(store, rank, size, *args, **kwargs)
        options = cls.real._Options()
        options._devices = [_shared_device(cls.real)]
        options._threads = 1
        options._timeout = timeout
        return cls.real(store, rank, size, options)

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, cls.real)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls.real)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls.real, name)


def share_single_rank_devices() -> bool:
    """Install the stand-in in this process (idempotent); False where torch has no gloo or lacks
    what it needs (nothing replaced then)."""
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return False
    real = getattr(c10d, "ProcessGroupGloo", None)
    if real is None:
        return False
    if isinstance(type(real), _StandIn):
        return True
    if not (hasattr(real, "_Options") and hasattr(real, "create_default_device")):
        logger.warning("fineslab: this torch's ProcessGroupGloo has no _Options or "
                       "create_default_device; each gloo group keeps a device of its own")
        return False
    stand_in = _StandIn("ProcessGroupGloo", (), {"__module__": real.__module__,
                                                  "__doc__": real.__doc__})
    stand_in.real = real
    setattr(c10d, "ProcessGroupGloo", stand_in)  # noqa: B010  (the name torch calls)
    return True
