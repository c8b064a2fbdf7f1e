"""A custom SGLang launch whose runtime keeps its KV in a fineslab slab arena, with neither the
fineslab launcher nor the plugin's entry point doing the work (`examples/custom-sglang.ipynb`).

    python examples/custom_launch.py --arena NAME --runtime-id ID -- <sglang.launch_server args>

The arena must exist (created with `fineslab.slabs`, see the notebook). SGLang's own
`launch_server(server_args, run_scheduler_process_func=...)` takes the function each scheduler
process runs, a seam SGLang keeps for private forks; this script passes `run_scheduler_in_arena`
bound to the join request, which calls `fineslab.sglang_plugin.install(ArenaJoin(...))` in the
scheduler process, before SGLang builds its KV pool, and then SGLang's `run_scheduler_process`.
No file of SGLang is patched and no module attribute is swapped.

SGLang starts its schedulers with multiprocessing "spawn": the target is pickled by name, so it
lives at module level here (the spawned process imports this file as `__mp_main__`), and the
join request travels as a `functools.partial` argument, not as FINESLAB_ARENA /
FINESLAB_RUNTIME_ID: this script refuses to run with those set, so the entry point `register()`
that SGLang loads in every process finds nothing to do.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from fineslab.env import ARENA_VAR, RUNTIME_ID_VAR
from fineslab.sglang_plugin import ArenaJoin


def run_scheduler_in_arena(join: ArenaJoin, *args: Any, **kwargs: Any) -> None:
    """Install the arena pool in this (scheduler) process, then run SGLang's scheduler."""
    from sglang.srt.managers.scheduler import run_scheduler_process

    from fineslab.sglang_plugin import install

    seen = {name: os.environ.get(name) for name in (ARENA_VAR, RUNTIME_ID_VAR)}
    print(f"custom_launch: scheduler pid {os.getpid()} env {seen}; "
          f"install(ArenaJoin({join.arena_name!r}, {join.runtime_id!r}))",
          file=sys.stderr, flush=True)
    install(join)
    run_scheduler_process(*args, **kwargs)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arena", required=True, help="the arena's name (its fleet id)")
    parser.add_argument("--runtime-id", required=True, help="this runtime's id in the arena")
    parser.add_argument("sglang_args", nargs=argparse.REMAINDER,
                        help="`--` then sglang.launch_server's arguments")
    args = parser.parse_args(argv)
    leaked = [name for name in (ARENA_VAR, RUNTIME_ID_VAR) if os.environ.get(name)]
    if leaked:
        parser.error(f"unset {leaked}: here install() joins the arena, not the entry point")
    sglang_args = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args

    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()  # as `python -m sglang.launch_server` does
    server_args = prepare_server_args(sglang_args)
    server_args.resolve_once()  # as sglang.launch_server's run_server does
    join = ArenaJoin(args.arena, args.runtime_id)
    try:
        launch_server(server_args,
                      run_scheduler_process_func=functools.partial(run_scheduler_in_arena, join))
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
