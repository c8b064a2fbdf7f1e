"""`python -m fineslab.cpu_mode.forked sglang.launch_server ARGS...`: SGLang's server with its
scheduler and detokenizer forked from the launching process instead of spawned (CPU only).

Why: SGLang forces the `spawn` start method, so each of a runtime's two child processes imports
SGLang afresh: about 13 s of CPU each on this project's 2-core machines, most of a runtime's
start. Forked, they inherit the launching process's imports (and the plugin it loaded): a
llama-tiny runtime was up in 31 s instead of 52 s here, greedy output the same
(docs/plugin.md). Forking is safe on CPU because nothing in the launching process has started a
thread pool or a device context by then; on a GPU it is not (CUDA cannot survive a fork), so
only CPU runtimes start this way (`ServerSpec.argv`).

How: the module named first is run as `__main__` (so the process's command line still names
`sglang.launch_server`), with SGLang's `_set_envs_and_config` (where it forces `spawn`)
followed by `set_start_method("fork")`. That name (`FORK_TARGET`) is looked up when the server
starts; if it is gone the server starts with `spawn`, and says so.
"""

from __future__ import annotations

import logging
import multiprocessing
import runpy
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: The SGLang function after which the start method is switched (it sets `spawn`).
FORK_TARGET = ("sglang.srt.entrypoints.engine", "_set_envs_and_config")


def fork_children() -> bool:
    """Make SGLang's launch fork its children; False (and a warning) if its seam is gone."""
    import importlib

    module = importlib.import_module(FORK_TARGET[0])
    original: Callable[..., Any] | None = getattr(module, FORK_TARGET[1], None)
    if original is None:
        logger.warning("fineslab: %s.%s is gone in this SGLang; its children are spawned",
                       *FORK_TARGET)
        return False

    def then_fork(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        multiprocessing.set_start_method("fork", force=True)
        return result

    setattr(module, FORK_TARGET[1], then_fork)
    return True


USAGE = "usage: python -m fineslab.cpu_mode.forked MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\nRun MODULE (sglang.launch_server) as __main__ with SGLang's scheduler "
              "and detokenizer forked\nfrom this process instead of spawned (CPU only); "
              "fineslab starts its CPU runtimes this way.")
        return 0
    if not args or args[0].startswith("-"):
        print(f"{USAGE}\n(the module to run comes first; fineslab starts CPU runtimes this way)",
              file=sys.stderr)
        return 2
    target = args[0]
    fork_children()
    sys.argv = [target, *args[1:]]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
