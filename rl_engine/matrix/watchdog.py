"""Process groups that die with the process that started them, however it dies (SIGKILL too).

A matrix cell or a gate step runs in a session of its own (so that it and its workers can be
killed as one group), which also frees it from its starter's death. Two things bind it back:
- `die_with(pid)`, the child's preexec_fn: a parent-death signal (SIGKILL) on the child itself;
- `Watchdog`: a small process (this file run as `python -I watchdog.py`, in a session of its own)
  reading a pipe that only the starter holds open. The starter writes `+<pgid>` when a group
  starts and `-<pgid>` once it is gone; end of input means the starter has exited, and every group
  still listed gets SIGKILL, its workers included.
Standard library only, so that the watchdog starts in a few milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # loaded before any fork
_PR_SET_PDEATHSIG = 1
_INFRASTRUCTURE = 3  # errors.INFRASTRUCTURE; this file also runs alone, without the package


def die_with(parent: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL when `parent` dies; a parent already gone ends the child at once. It
    runs between fork and exec, so it only calls the C function loaded before the fork. (The
    signal follows the thread that started the child: start it from one that waits for it.)"""
    def arm() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(_INFRASTRUCTURE)
    return arm


class Watchdog:
    """The starter's watchdog process: one per starting process, started with its first group."""

    proc: subprocess.Popen | None = None

    @classmethod
    def _tell(cls, line: str) -> None:
        for _ in range(2):  # a watchdog that died (someone killed it) is replaced once
            if cls.proc is None or cls.proc.poll() is not None:
                cls.proc = subprocess.Popen([sys.executable, "-I", str(Path(__file__))],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True,
                                            text=True)
            try:
                cls.proc.stdin.write(line + "\n")
                cls.proc.stdin.flush()
                return
            except BrokenPipeError:
                cls.proc = None

    @classmethod
    def watch(cls, pgid: int) -> None:
        cls._tell(f"+{pgid}")

    @classmethod
    def forget(cls, pgid: int) -> None:
        cls._tell(f"-{pgid}")


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
