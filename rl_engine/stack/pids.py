"""The processes a service of the embedded stack started, found from what its pid file records.

A pid alone is not an identity (pids are reused), so a service is its leader's pid *and* start
time; what the leader started is its process tree plus members of its session (it is a session
leader) that were re-parented since, started after it.
"""

from __future__ import annotations

import os
import signal

import psutil


def leader(pid: int, create_time: float) -> psutil.Process | None:
    """The live, non-zombie process with this pid and start time, else None."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def started_by(pid: int, create_time: float, *, marker: str | None = None) -> list[psutil.Process]:
    """The leader, its descendants, re-parented members of its session, and (with `marker`) any
    process started after it whose command line names the marker (e.g. its temp folder)."""
    root = leader(pid, create_time)
    procs: dict[int, psutil.Process] = {}
    if root is not None:
        procs[root.pid] = root
        try:
            procs.update((p.pid, p) for p in root.children(recursive=True))
        except psutil.Error:
            pass
    for p in psutil.process_iter(["cmdline", "create_time"]):
        try:
            if p.info["create_time"] < create_time - 1.0:
                continue
            named = marker is not None and any(marker in arg for arg in (p.info["cmdline"] or []))
            if named or (root is not None and os.getsid(p.pid) == pid):
                procs.setdefault(p.pid, p)
        except (psutil.Error, OSError):
            continue
    procs.pop(os.getpid(), None)
    return list(procs.values())


def kill(procs: list[psutil.Process], timeout: float = 15) -> None:
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)
