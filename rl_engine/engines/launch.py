"""Starts N torch.distributed ranks running one function and collects their results.

Ranks are local processes (default) or Ray actors (RLK_LAUNCHER=ray). A rank that fails fails the
whole group promptly with that rank's error (WorkerFailed, exit code 3); a parent killed with
SIGKILL leaves no worker behind (each worker asks the kernel for SIGKILL when its parent dies).

On the CPU the ranks form a gloo group. On CUDA each rank owns one GPU (local rank modulo the
visible GPUs) and the group has two backends: NCCL for CUDA tensors, gloo for CPU tensors and
object collectives. What a rank returns is moved to the CPU before it leaves the rank, so no CUDA
tensor crosses processes.
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

DEVICES: tuple[str, ...] = ("cpu", "cuda")
# Every CUDA rank runs without NVLink SHARP multicast: its in-switch reductions do not add in a
# fixed order, and its multicast objects need a fabric setup that shared machines often lack.
CUDA_ENV: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                            "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerFailed(RuntimeError):
    """A rank died or raised; the message carries its rank and error (exit code 3)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    # The request only covers a parent that dies from now on; one already gone has left this
    # process with another parent.
    if os.getppid() != parent_pid:
        os._exit(3)


def check_devices(world: int, device: str) -> None:
    """Refuses a launch the machine cannot hold (ValueError, exit code 2): on CUDA every rank needs
    a GPU of its own, since NCCL refuses two ranks of one communicator on one GPU."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: use cpu or cuda")
    if device != "cuda":
        return
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise ValueError("device cuda: no CUDA device is visible; use --device cpu")
    if world > visible:
        raise ValueError(f"world {world} needs {world} GPUs, {visible} visible; lower TP/CP or use "
                         "more GPUs")


def init_rank(rank: int, world: int, init_method: str, device: str, local_rank: int) -> None:
    """Joins this process to the group as `rank`; on CUDA it first takes its GPU."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)


def rank_device(device: str):
    """The torch device of this rank's tensors: the GPU the launcher gave it, or the CPU."""
    import torch

    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_cpu(value: Any) -> Any:
    """value with every CUDA tensor inside its dicts, lists and tuples moved to the CPU."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if type(value) is dict:
        return {k: to_cpu(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(to_cpu(v) for v in value)
    return value


def _log_to_run_log() -> None:
    """Workers append their log lines (route lines among them) to the run's run.log."""
    import logging

    path = os.environ.get("RLK_RUN_LOG")
    if path:
        handler = logging.FileHandler(path, mode="a")
        handler.setFormatter(logging.Formatter("%(asctime)s pid=%(process)d %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)


def _worker(rank: int, world: int, port: int, payload: bytes, results, device: str,
            parent_pid: int, first_gpu: int = 0) -> None:
    # fn and its arguments arrive as bytes and are unpickled only here, after the death signal is
    # armed: unpickling imports torch and the engines, seconds during which the parent may die.
    _die_with_parent(parent_pid)
    fn, args = pickle.loads(payload)
    if device == "cuda":
        os.environ.update(CUDA_ENV)  # before NCCL reads its settings
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _log_to_run_log()
    try:
        init_rank(rank, world, f"tcp://127.0.0.1:{port}", device, local_rank=first_gpu + rank)
        out = fn(rank, world, *args)
        if device == "cuda":
            out = to_cpu(out)
        # Plain pickle bytes: the queue's own pickler would pass tensor storage as a file
        # descriptor that dies with this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - the error travels to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(3)
    finally:
        if device == "cuda":
            from rl_engine.distributed import cuda_ipc

            cuda_ipc.release()  # unmaps the peers' IPC buffers while the CUDA context is alive
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world: int, *, args: tuple = (), timeout: float | None = None,
           device: str = "cpu", first_gpu: int = 0) -> list[Any]:
    """Runs fn(rank, world, *args) on `world` ranks on `device` (cpu or cuda); returns their
    results in rank order. On CUDA rank r takes GPU first_gpu + r of this machine (Ray places its
    ranks itself)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: use cpu or cuda")
    if envs.RLK_LAUNCHER == "ray":
        from rl_engine.engines.ray_launch import launch_ray

        if device == "cpu":
            return launch_ray(fn, world, args=args, timeout=timeout)
        return launch_ray(fn, world, args=args, timeout=timeout, gpus_per_rank=1, device=device)
    check_devices(first_gpu + world, device)
    return _launch_local(fn, world, args=args, timeout=timeout, device=device, first_gpu=first_gpu)


def _launch_local(fn, world: int, *, args: tuple, timeout: float | None,
                  device: str = "cpu", first_gpu: int = 0) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    payload = pickle.dumps((fn, args))
    procs = [ctx.Process(target=_worker, args=(r, world, port, payload, results, device,
                                               os.getpid(), first_gpu), daemon=True)
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
