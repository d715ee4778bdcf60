"""Subprocesses of the gate steps: the checkout's code first on the path, output kept in a log and
echoed (a Ray job's log is its stdout), and the whole session killed when the step ends or stops,
or when the step's process dies, even by SIGKILL (rl_engine/matrix/watchdog.py)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

from rl_engine.errors import InfrastructureError
from rl_engine.matrix.watchdog import Watchdog, die_with

_KILL_GRACE_S = 5.0


def product_env(root: Path, **overrides: str | None) -> dict[str, str]:
    """Our environment with the checkout first on PYTHONPATH (Python workers inherit it); an
    override of None unsets the variable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _pump(stream, out) -> None:
    for line in stream:
        out.write(line)
        out.flush()
        sys.stdout.write(line)  # a Ray job's log is its stdout
        sys.stdout.flush()


def _on_term(signum, frame) -> None:
    raise InfrastructureError("stopped by SIGTERM (the job was stopped)")


def _kill_session(proc: subprocess.Popen) -> None:
    """Ends the whole session: a run's worker processes go with it. SIGTERM first, with a grace
    period while the leader lives; then SIGKILL for whatever is left."""
    for sig, wait in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def run_logged(cmd: Sequence[Any], *, cwd: Path, log: Path, env: dict[str, str] | None = None,
               timeout: float | None = None) -> int | None:
    """Runs cmd in its own session, its output appended to log and echoed to ours; returns its exit
    code, or None when it ran past timeout. Whatever is left of the session is killed when this
    returns or raises (a SIGTERM of the step included), so no worker outlives the step."""
    argv = [str(c) for c in cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as out:
        shown = ["<script>" if "\n" in a else a for a in argv]  # an inline script stays one line
        out.write(f"$ {shlex.join(shown)}\n")
        out.flush()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True, preexec_fn=die_with(os.getpid()))
        Watchdog.watch(proc.pid)
        pump = threading.Thread(target=_pump, args=(proc.stdout, out), daemon=True)
        pump.start()
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, _on_term) if main else None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            _kill_session(proc)
            Watchdog.forget(proc.pid)
            pump.join(timeout=10)
            if main:
                signal.signal(signal.SIGTERM, before)


def last_error(log: Path) -> str | None:
    """The last `error (...)` line an rlk verb printed into log, if any."""
    try:
        text = log.read_text(errors="replace")[-65536:]
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.lstrip().startswith("error (")]
    return lines[-1] if lines else None
