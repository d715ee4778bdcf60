"""Kills a matrix runner's cells when the runner dies, however it dies (SIGKILL included).

Run by the runner as `python -I watchdog.py` in a session of its own, with a pipe as stdin that
only the runner holds open. The runner writes `+<pgid>` when a cell's process group starts and
`-<pgid>` once it is gone. End of input means the runner has exited: every group still listed
gets SIGKILL, so no cell (nor any worker of it) outlives its runner to write into an attempt that
a resumed matrix may be judging. Standard library only: it starts in a few milliseconds.
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> int:
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line[:1] in ("+", "-") and line[1:].isdigit():
            (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:  # already gone
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
