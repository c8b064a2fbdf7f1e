"""Counted starts: every SGLang runtime, zygote, in-process engine and Ray cluster fineslab starts,
one JSON line each in the file `FINESLAB_START_LOG` names (unset: nothing is written).

    {"event": "begin", "what": "sglang-server", "how": "warm", "pid": 123, "detail": "..."}
    {"event": "ready", "what": "sglang-server", "how": "warm", "pid": 123, "seconds": 4.1}

The test suite sets the variable for itself and every process it starts (launchers, node
fleets, benchmarks inherit it) and reports the counts and seconds at its end
(tests/start_counting.py); an operator can set it to see where a fleet's start-up went. Lines
are appended with one `write` on an O_APPEND descriptor, so concurrent writers do not mix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from fineslab.env import FineslabEnv

#: What is counted: an SGLang server (`ServerProcess`), an in-process `sglang.Engine`, a Ray
#: cluster (`fineslab.cluster.local.LocalCluster`).
KINDS = ("sglang-server", "sglang-engine", "ray-cluster")


def record(event: str, what: str, how: str = "", seconds: float | None = None,
           detail: str = "") -> None:
    """Append one line (see the module docstring) if `FINESLAB_START_LOG` is set."""
    path = FineslabEnv.from_environ().start_log
    if not path:
        return
    body: dict[str, object] = {"event": event, "what": what, "how": how, "pid": os.getpid()}
    if seconds is not None:
        body["seconds"] = round(seconds, 3)
    if detail:
        body["detail"] = detail
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(body) + "\n").encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class StartRecord:
    event: str
    what: str
    how: str
    seconds: float | None
    detail: str


def read(path: Path, offset: int = 0) -> tuple[list[StartRecord], int]:
    """The records from byte `offset` on (whole lines only) and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    whole = data[:data.rfind(b"\n") + 1]
    records = []
    for line in whole.splitlines():
        try:
            body = json.loads(line)
        except ValueError:
            continue
        records.append(StartRecord(str(body.get("event")), str(body.get("what")),
                                   str(body.get("how", "")), body.get("seconds"),
                                   str(body.get("detail", ""))))
    return records, offset + len(whole)
