"""The suite's counted starts (issue #34): how many SGLang runtimes, in-process engines and Ray
clusters a run started, how long they took, and a failure for a test that starts one without
the `slow` marker.

conftest.py points `FINESLAB_START_LOG` at a file of the run's own before any test runs, so
every process the suite starts (launchers, node fleets, benchmarks) appends to it
(fineslab.startlog). After each phase of each test (setup, call, teardown) the new lines are
read: they belong to that test (a module fixture's starts to the first test that uses it).
Under pytest-xdist each worker counts its own tests' starts in a file of its own and hands its
counts to the controller when it ends (`to_json` / `merge`), which prints the whole run's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from fineslab import startlog
from fineslab.env import START_LOG_VAR


class StartCounter:
    def __init__(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="fineslab-starts-"))
        self.path = folder / "starts.jsonl"
        self.offset = 0
        self.begun: Counter[tuple[str, str]] = Counter()
        self.seconds: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.by_test: Counter[str] = Counter()
        #: The tests whose warm starts failed and were started again plainly (a defect to see).
        self.warm_failed: list[str] = []
        #: Why launchers started zygotes of their own beside the suite's (conftest.py).
        self.own_zygotes: Counter[str] = Counter()
        self.workers = 0  # xdist workers whose counts were merged
        os.environ[START_LOG_VAR] = str(self.path)

    def new_begins(self, nodeid: str) -> list[startlog.StartRecord]:
        records, self.offset = startlog.read(self.path, self.offset)
        for r in records:
            if r.event == "ready" and r.seconds is not None:
                self.seconds[(r.what, r.how)] += float(r.seconds)
        begins = [r for r in records if r.event == "begin"]
        for r in begins:
            self.begun[(r.what, r.how)] += 1
            if r.how == "plain-after-warm":
                self.warm_failed.append(nodeid)
            if r.what == "zygote" and r.detail:
                self.own_zygotes[r.detail] += 1
        self.by_test[nodeid] += len(begins)
        return begins

    def to_json(self) -> str:
        """This process's counts (an xdist worker's, for the controller)."""
        self.new_begins("(after the last test)")
        return json.dumps({"begun": [[w, h, n] for (w, h), n in self.begun.items()],
                           "seconds": [[w, h, s] for (w, h), s in self.seconds.items()],
                           "by_test": dict(self.by_test), "warm_failed": self.warm_failed,
                           "own_zygotes": dict(self.own_zygotes)})

    def merge(self, text: str) -> None:
        """Add a worker's counts (`to_json`)."""
        data = json.loads(text)
        for what, how, n in data["begun"]:
            self.begun[(what, how)] += n
        for what, how, seconds in data["seconds"]:
            self.seconds[(what, how)] += seconds
        self.by_test.update(data["by_test"])
        self.warm_failed += data.get("warm_failed", [])
        self.own_zygotes.update(data.get("own_zygotes", {}))
        self.workers += 1

    def remove(self) -> None:
        """The run's start log goes with the run (its counts were printed)."""
        shutil.rmtree(self.path.parent, ignore_errors=True)

    def summary_lines(self) -> list[str]:
        self.new_begins("(after the last test)")
        lines = [f"{n:4d} x {what} ({how}), {self.seconds[(what, how)]:.0f} s to ready in all"
                 for (what, how), n in sorted(self.begun.items())]
        total = sum(self.begun.values())
        busiest = ", ".join(f"{nodeid} {n}" for nodeid, n in self.by_test.most_common(5) if n)
        where = (f"counted by {self.workers} workers, each in a {START_LOG_VAR} of its own"
                 if self.workers else f"{START_LOG_VAR}={self.path}")
        failed = [f"warm starts started again plainly in: {', '.join(self.warm_failed)}"] \
            if self.warm_failed else []
        own = [f"zygotes of their own, {n} x: {why}" for why, n in self.own_zygotes.most_common()]
        return [f"starts: {total} ({where})", *lines,
                f"most starts: {busiest or 'none'}", *failed, *own]


def check_phase(counter: StartCounter, item: pytest.Item, report: pytest.TestReport) -> None:
    """Fail the phase's report if the test started SGLang or Ray without the `slow` marker."""
    begins = counter.new_begins(item.nodeid)
    if not begins or item.get_closest_marker("slow") is not None or report.failed:
        return
    kinds = ", ".join(sorted({f"{r.what} ({r.how})" for r in begins}))
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} started {len(begins)} of {kinds} in its {report.when} "
                       "without the `slow` marker: mark it slow (tests/start_counting.py)")
