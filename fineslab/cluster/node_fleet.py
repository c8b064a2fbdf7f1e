"""One node's share of a cluster fleet, run by that node's agent as its own process.

    python -m fineslab.cluster.node_fleet --spec SPEC.pickle --work-dir DIR --stop-with-fd N

SPEC (written by `NodeAgent.start_fleet`) holds the node's fleet config and its share of the
global placement. This is the one-machine launcher (`fineslab.launch`) with the placement
given: arenas, supervised SGLang runtimes and the node router with its local scheduler, on the
node's address and a free port.

It first forks and the parent exits, so that the node fleet is not a child of the agent's
worker: Ray SIGKILLs a worker's direct children when the worker exits (its node lost,
`ray.kill`), and a SIGKILLed launcher cannot stop its runtimes gracefully. The fleet then
stops cleanly on SIGTERM/SIGINT or when fd N reads EOF, which happens however the agent goes;
if it is itself killed, each runtime's lifeline (fineslab.lifeline) stops that runtime and
removes the arena files. Files in DIR, for the agent:
    pid.json    [pid, start ticks] of the node fleet (after the fork)
    ready.json  once it serves: {"url", "pid", "used_bytes"} (`used_bytes`: per device, the
                placed footprints plus the arena, what a later placement there must leave alone)
    exit.json   {"rc"} when it has stopped (DIR is removed instead when the agent is gone)
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fineslab.errors import FatalError
from fineslab.fleet.config import FleetConfig
from fineslab.jsonfile import write_json_whole
from fineslab.scheduler.placement import PlacementPlan

if TYPE_CHECKING:
    from fineslab.fleet.machine import Fleet
    from fineslab.fleet.plan import FleetPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeSpec:
    config: FleetConfig
    placement: PlacementPlan
    host: str  # the node router binds here (the node's address as Ray knows it)
    log_dir: str


def used_bytes(plan: FleetPlan) -> dict[str, int]:
    """Per device name: the footprints the placement put there plus the arena's bytes."""
    used = {d.name: plan.placement.fixed_bytes_on(i) for i, d in enumerate(plan.devices)}
    for arena in plan.arenas:
        used[arena.device.name] = used.get(arena.device.name, 0) + arena.arena_bytes
    return used


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineslab.cluster.node_fleet", description=(
        "Run one node's share of a cluster fleet (started by the node agent)."))
    parser.add_argument("--spec", required=True)
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--stop-with-fd", type=int, default=None)
    parser.add_argument("--agent-pid", type=int, default=None,
                        help="the agent; when it is gone at exit, this removes --work-dir")
    args = parser.parse_args(argv)
    if os.fork():  # before any thread or heavy import: the parent only lets go of the child
        os._exit(0)
    from fineslab.proctree import ProcessIdentity

    me = ProcessIdentity.current()
    write_json_whole(args.work_dir / "pid.json", [me.pid, me.start_ticks])
    agent = ProcessIdentity(args.agent_pid, 0) if args.agent_pid else None
    rc = 1
    try:
        rc = _serve(args)
    finally:
        write_json_whole(args.work_dir / "exit.json", {"rc": rc})
        if agent is not None and not agent.is_alive():  # nobody will read it
            shutil.rmtree(args.work_dir, ignore_errors=True)
    return rc


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from fineslab.fleet.plan import make_plan
    from fineslab.fleet.serve import run_fleet

    try:
        # written by our own agent; its class is this module's by its import name, not __main__
        from fineslab.cluster.node_fleet import NodeSpec as Spec

        spec = pickle.loads(Path(args.spec).read_bytes())
        if not isinstance(spec, Spec):
            raise FatalError(f"{args.spec} is not a node spec ({type(spec).__name__})")
        config = spec.config.model_copy(update={"router": spec.config.router.model_copy(
            update={"host": spec.host, "port": 0})})
        plan = make_plan(config, placement=spec.placement)
        print(plan.describe(), flush=True)
        ready = args.work_dir / "ready.json"

        def on_ready(fleet: Fleet) -> None:
            write_json_whole(ready, {"url": f"http://{spec.host}:{fleet.port}",
                                     "pid": os.getpid(), "used_bytes": used_bytes(plan)})

        return run_fleet(plan, port=0, log_dir=spec.log_dir, stop_fd=args.stop_with_fd,
                         on_ready=on_ready)
    except FatalError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
