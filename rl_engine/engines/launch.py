"""Starts N torch.distributed ranks running one function and collects their results.

Ranks are local processes (default) or Ray actors (RLK_LAUNCHER=ray). A rank that fails fails the
whole group promptly with that rank's error (WorkerFailed, exit code 3); a parent killed with
SIGKILL leaves no worker behind (each worker asks the kernel for SIGKILL when its parent dies).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from typing import Any, Callable

from rl_engine import envs


class WorkerFailed(RuntimeError):
    """A rank died or raised; the message carries its rank and error (exit code 3)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _log_to_run_log() -> None:
    """Workers append their log lines (route lines among them) to the run's run.log."""
    import logging

    path = os.environ.get("RLK_RUN_LOG")
    if path:
        handler = logging.FileHandler(path, mode="a")
        handler.setFormatter(logging.Formatter("%(asctime)s pid=%(process)d %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results) -> None:
    _die_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _log_to_run_log()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        out = fn(rank, world, *args)
        # Plain pickle bytes: the queue's own pickler would pass tensor storage as a file
        # descriptor that dies with this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - the error travels to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(3)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world: int, *, args: tuple = (), timeout: float | None = None) -> list[Any]:
    """Runs fn(rank, world, *args) on `world` ranks; returns their results in rank order."""
    if envs.RLK_LAUNCHER == "ray":
        from rl_engine.engines.ray_launch import launch_ray

        return launch_ray(fn, world, args=args, timeout=timeout)
    return _launch_local(fn, world, args=args, timeout=timeout)


def _launch_local(fn, world: int, *, args: tuple, timeout: float | None) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in out]
                if dead:
                    rank, code = dead[0]
                    raise WorkerFailed(f"rank {rank} of {world} died with exit code {code}")
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerFailed(f"ranks {sorted(set(range(world)) - set(out))} did not "
                                       f"finish within {timeout:.0f} s")
                continue
            if status == "error":
                raise WorkerFailed(f"rank {rank} of {world} failed: {value}")
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
    return [out[r] for r in range(world)]
