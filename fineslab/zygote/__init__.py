"""Warm starts: SGLang imported once per launcher, each runtime forked from there.

A plain start of a runtime is a fresh interpreter that imports torch and SGLang's server,
scheduler and model code (16.5 s of CPU for the HTTP server's import alone on this project's
2-core machines) before it reads its first argument. The zygote (`server.py`) pays that import
once per launcher (and per node fleet); every runtime is then a fork of it (`child.py`), told
its arguments, environment, log and lifeline after the fork (`protocol.py`), and seen by the
launcher as `subprocess.Popen` shows a child (`client.ForkedProcess`).

    launcher ──unix socket──> zygote (imported, no CUDA, no threads of its own)
        │                       └─fork─> wrapper (lifeline) ─fork─> sglang server ─> scheduler
        └── lifeline pipe ──────────────────┘ (every runtime and the zygote die with it)

Guarantees:
- a runtime forked here behaves as a plain start of the same command: same arguments,
  environment, command line in `ps`, process group, log and lifeline (tests prove two runtimes
  of different models and settings from one zygote each see only their own);
- the zygote never initialises CUDA; if CUDA is initialised when a fork is asked for, or the
  zygote cannot start, that start is plain and the log says why (`ZygoteUnavailable`); a
  runtime that fails during a warm start is started again plainly
  (`fineslab.runtime.ServerProcess`);
- a runtime whose environment differs from the zygote's in a variable a module may read at
  import gets a zygote started with its environment (`shared_zygote`);
- the zygote is not in its launcher's process tree (an in-process SGLang engine's shutdown
  kills every descendant of its process); the lifeline ties it to the launcher;
- a fork's environment as /proc shows it is its own (written over the zygote's), fleet marker
  included, so one zygote may fork for several fleets: a process may serve its zygote to its
  children's launchers (`serve_zygote`, `FINESLAB_SHARED_ZYGOTE`; the test suite does);
- `FINESLAB_ZYGOTE=0` turns warm starts off.
"""

from __future__ import annotations

from fineslab.zygote.client import (
    ForkedProcess,
    Zygote,
    ZygoteAbandoned,
    ZygoteUnavailable,
    dead_zygotes,
    revive_dead_zygotes,
    serve_zygote,
    shared_zygote,
    stop_shared_zygotes,
)

__all__ = ["ForkedProcess", "Zygote", "ZygoteAbandoned", "ZygoteUnavailable", "dead_zygotes",
           "revive_dead_zygotes", "serve_zygote", "shared_zygote", "stop_shared_zygotes"]
