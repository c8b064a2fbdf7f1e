"""A stand-in runtime for the zygote's protocol tests: `python -m echo_runtime OUT [sleep|exit N]`.

Writes what it was told (argv, FINESLAB_T, its host's RAY_* and TERM variables, folder, torch's
threads where the zygote imported torch) and where it runs (pid, group, session, parent) to OUT
as JSON, prints a line to its log, then sleeps or exits with N.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    out, action = sys.argv[1], sys.argv[2:]
    report = {"argv": sys.argv, "t": os.environ.get("FINESLAB_T"), "cwd": os.getcwd(),
              "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
              "ppid": os.getppid(), "main": __name__,
              "host": {k: v for k, v in os.environ.items() if k.startswith(("RAY_", "TERM"))},
              "threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules
              else None}
    with open(out + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(out + ".tmp", out)
    print(f"echo runtime {os.environ.get('FINESLAB_T')} up", flush=True)
    if action[:1] == ["exit"]:
        return int(action[1])
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
