"""Resident ranks: started once, each joined to one torch.distributed group, each serving calls.

`start(factory, world, ...)` starts `world` ranks, local processes (default) or Ray actors
(RLK_LAUNCHER=ray), that join one group and each build `factory(rank, world, *args)` once; then
`Group.call(method, *args)` runs that method of every rank's object and returns the results in rank
order, as often as the run needs. `launch(fn, world)` is the one-shot form. `start(..., wait=False)`
returns once the ranks are on their way, so that two groups (a trainer's and a rollout engine's)
build at once; `Group.ready()`, or `ready_all(...)` for several, then waits for the build, before
any call. Local ranks meet at a store their parent serves on a port it bound before they start.

A rank that fails fails the whole group promptly with its side, rank and error (WorkerFailed, exit
code 3), and the group's other ranks are killed; a parent killed with SIGKILL leaves no local rank
behind (each asks the kernel for SIGKILL when its parent dies). On the CPU the ranks form a gloo
group. On CUDA each rank owns one GPU and the group has two backends: NCCL for CUDA tensors, gloo
for CPU tensors and object collectives. What a rank returns is moved to the CPU before it leaves.

Under Ray, the cluster is the one at RLK_RAY_ADDRESS (host:port of its GCS, or ray://host:port), or
the one this process is already connected to (inside a Ray job). The ranks are actors in one
placement group (a GPU per bundle on CUDA); they and the group live exactly as long as the Group.
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from rl_engine import envs
from rl_engine.errors import BadInput, InfrastructureError

DEVICES: tuple[str, ...] = ("cpu", "cuda")
# Every CUDA rank runs without NVLink SHARP multicast: its in-switch reductions do not add in a
# fixed order, and its multicast objects need a fabric setup that shared machines often lack.
CUDA_ENV: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                            "NVSHMEM_DISABLE_NVLS": "1"}
# Settings of the launching process that Ray actors need too (they start with the cluster's
# environment, not the driver's).
FORWARDED_ENV = ("RLK_RUN_LOG",)
# Ray shows a GPU actor only its own GPU (CUDA_VISIBLE_DEVICES). The CUDA IPC collectives map the
# peers' buffers, which needs the peers' GPUs visible, so CUDA ranks keep the host's view and take
# the GPU Ray assigned them.
KEEP_ALL_GPUS = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class WorkerFailed(InfrastructureError):
    """A rank died or raised; the message carries its side, rank and error (exit code 3)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Joins this process to the group as `rank`; on CUDA it first takes its GPU. init_method is
    tcp://host:port (rank 0 serves the group's store there) or store://host:port (a store that
    another process already serves)."""
    import datetime

    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    if init_method.startswith("store://"):
        host, port = init_method.removeprefix("store://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world, is_master=False,
                              timeout=datetime.timedelta(seconds=envs.RLK_WORKER_START_TIMEOUT))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
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
    """Ranks append their log lines (route lines among them) to the run's run log."""
    import logging

    path = os.environ.get("RLK_RUN_LOG")
    if path:
        handler = logging.FileHandler(path, mode="a")
        handler.setFormatter(logging.Formatter("%(asctime)s pid=%(process)d %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)


def _prepare_rank(rank: int, world: int, init: str, device: str, local_rank: int) -> None:
    if device == "cuda":
        os.environ.update(CUDA_ENV)  # before NCCL reads its settings
    import torch

    torch.set_num_threads(1)
    _log_to_run_log()
    init_rank(rank, world, init, device, local_rank)


def _release_rank(device: str) -> None:
    import torch.distributed as dist

    if device == "cuda":
        from rl_engine.distributed import cuda_ipc

        cuda_ipc.release()  # unmaps the peers' IPC buffers while the CUDA context is alive
    if dist.is_initialized():
        dist.destroy_process_group()


class _Once:
    """The object of a one-shot launch: run() is fn(rank, world, *args)."""

    def __init__(self, rank: int, world: int, fn: Callable[..., Any], args: tuple):
        self.rank, self.world, self.fn, self.args = rank, world, fn, args

    def run(self) -> Any:
        return self.fn(self.rank, self.world, *self.args)


# -- local processes ------------------------------------------------------------------------------
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


def _serve(rank: int, world: int, init: str, payload: bytes, commands, results, device: str,
           parent_pid: int, first_gpu: int) -> None:
    # The factory and its arguments arrive as bytes and are unpickled only here, after the death
    # signal is armed: unpickling imports torch and the engines, seconds during which the parent
    # may die.
    _die_with_parent(parent_pid)
    factory, args = pickle.loads(payload)
    obj = None
    try:
        _prepare_rank(rank, world, init, device, first_gpu + rank)
        obj = factory(rank, world, *args)
        results.put((rank, "ok", pickle.dumps(None)))
        while (command := commands.get()) is not None:
            method, call_args = pickle.loads(command)
            out = getattr(obj, method)(*call_args)
            # Plain pickle bytes: the queue's own pickler would pass tensor storage as a file
            # descriptor that dies with this process before the parent reads it.
            results.put((rank, "ok", pickle.dumps(to_cpu(out) if device == "cuda" else out)))
    except BaseException as exc:  # noqa: BLE001 - the error travels to the parent
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(3)
    finally:
        _close(obj)
        _release_rank(device)


def _close(obj) -> None:
    """Lets a rank that holds an engine of its own (vLLM) stop it while its groups still exist."""
    close = getattr(obj, "close", None)
    if callable(close):
        close()


class _Local:
    def __init__(self, factory, world: int, args: tuple, device: str, first_gpu: int, name: str):
        ctx = mp.get_context("spawn")
        self.world, self.name = world, name
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        # The group's store is served from here, on a port bound now: a port only chosen here and
        # bound later by rank 0 could be taken meanwhile by a group building beside this one.
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        init, payload = f"store://127.0.0.1:{self.store.port}", pickle.dumps((factory, args))
        self.procs = [ctx.Process(target=_serve, args=(r, world, init, payload, self.commands[r],
                                                       self.results, device, os.getpid(), first_gpu),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def ready(self, timeout: float | None) -> None:
        self.collect(timeout)

    def collect(self, timeout: float | None) -> list[Any]:
        out: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(out) < self.world:
            try:
                rank, status, value = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs)
                        if p.exitcode is not None and r not in out]
                if dead:
                    rank, code = dead[0]
                    raise WorkerFailed(f"{self.name} rank {rank} of {self.world} died with exit "
                                       f"code {code}")
                if deadline is not None and time.monotonic() > deadline:
                    raise WorkerFailed(f"{self.name} ranks {sorted(set(range(self.world)) - set(out))} "
                                       f"did not answer within {timeout:.0f} s")
                continue
            if status == "error":
                raise WorkerFailed(f"{self.name} rank {rank} of {self.world} failed: {value}")
            out[rank] = pickle.loads(value)
        return [out[r] for r in range(self.world)]

    def call(self, method: str, args: tuple, timeout: float | None) -> list[Any]:
        command = pickle.dumps((method, args))
        for q in self.commands:
            q.put(command)
        return self.collect(timeout)

    def close(self, failed: bool) -> None:
        if not failed:
            for q in self.commands:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        self.store = None


# -- Ray actors -----------------------------------------------------------------------------------
def cluster_address() -> str:
    """What ray.init joins. An http(s) address is the Jobs API (what Airflow submits to), which
    ray.init cannot join; inside a Ray job Ray sets RAY_ADDRESS to the cluster itself, so that wins."""
    address = envs.RLK_RAY_ADDRESS
    if not address:
        return "auto"
    if address.startswith(("http://", "https://")):
        inside = os.environ.get("RAY_ADDRESS", "")
        if inside and not inside.startswith(("http://", "https://")):
            return "auto"
        raise BadInput(f"RLK_RAY_ADDRESS={address} is a Jobs API address; the ray launcher joins a "
                       "cluster at host:port (its GCS) or ray://host:port")
    return address


def _join(address: str) -> None:
    """ray.init at address, failing fast when nothing listens there. A head on the loopback only (the
    embedded one) is joined in Ray's single-machine mode, as the head itself runs: otherwise Ray
    swaps 127.0.0.1 for the machine's routable address, where nothing listens, and retries for
    minutes. That mode is read when ray is imported, so it is set before the import."""
    host, _, port = address.rpartition(":")
    if address != "auto" and "://" not in address:
        if host in ("localhost", "::1") or host.startswith("127."):
            if "ray" not in sys.modules:
                os.environ.setdefault(SINGLE_MACHINE, "0")
            elif os.environ.get(SINGLE_MACHINE) != "0":
                raise InfrastructureError(
                    f"ray was imported before {SINGLE_MACHINE}=0 was set, so it cannot join the "
                    f"loopback-only cluster at {address}; set it before ray is imported")
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except (OSError, ValueError) as exc:
            raise InfrastructureError(f"no Ray cluster answers at {address}: {exc}") from None
    import ray

    ray.init(address=address, log_to_driver=True)
    atexit.register(_leave_ray)


def _leave_ray() -> None:
    """Disconnects this driver at exit. Registered after ray.init, so it runs before Ray's own exit
    hook (handlers run last-registered first), which sleeps 0.5 s before disconnecting so that the
    workers' last log lines arrive. That wait is kept while any rank group of this process did not
    close cleanly (a failing rank's last words); otherwise it only delays every matrix cell."""
    import ray

    if _Ray.unsettled == 0 and ray.is_initialized():
        ray.shutdown()


def _rank_actor_class():
    import ray

    @ray.remote(max_restarts=0, max_task_retries=0)
    class RankActor:
        def address(self) -> str:
            return ray.util.get_node_ip_address()

        def gpu(self) -> tuple[str | None, list[int]]:
            """CUDA_VISIBLE_DEVICES as this actor sees it, and the GPUs Ray assigned it."""
            return os.environ.get("CUDA_VISIBLE_DEVICES"), [int(i) for i in ray.get_gpu_ids()]

        def free_port(self) -> int:
            return free_port()

        def setup(self, rank: int, world: int, init: str, factory, args: tuple,
                  env: dict[str, str], device: str = "cpu") -> None:
            os.environ.update(env)
            self.device = device
            _prepare_rank(rank, world, init, device, self.gpu()[1][0] if device == "cuda" else 0)
            self.obj = factory(rank, world, *args)

        def call(self, method: str, args: tuple) -> Any:
            out = getattr(self.obj, method)(*args)
            return to_cpu(out) if self.device == "cuda" else out

        def release(self) -> None:
            # Only after success: a failed rank keeps its connections open until the launcher
            # kills it, so its peers do not fail first on a closed connection and hide the cause.
            _close(getattr(self, "obj", None))
            _release_rank(self.device)

    return RankActor


def _failure(exc: Exception) -> str:
    """The remote error as `Type: message` and its traceback, without Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        tb = getattr(exc, "traceback_str", "")
        return f"{type(cause).__name__}: {cause}\n{tb}".rstrip()
    return f"{type(exc).__name__}: {exc}"


def actor_options(pg, bundle: int, gpus_per_rank: float, device: str) -> dict[str, Any]:
    """Where and how the actor of one rank starts: its bundle of the group's placement group, and
    on CUDA the host's whole GPU view (KEEP_ALL_GPUS)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle),
        "num_cpus": 1, "num_gpus": gpus_per_rank}
    if device == "cuda":
        options["runtime_env"] = {"env_vars": dict(KEEP_ALL_GPUS)}
    return options


class _Ray:
    # Groups of this process that started and have not closed cleanly (see _leave_ray).
    unsettled = 0

    def __init__(self, factory, world: int, args: tuple, device: str, name: str):
        if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
            _join(cluster_address())  # before any ray import of ours: see _join
        _Ray.unsettled += 1
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        from ray.util.placement_group import placement_group

        self.world, self.name, self.actors = world, name, []
        gpus = 1 if device == "cuda" else 0
        bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
        # CUDA ranks share memory over IPC, which only works between the GPUs of one host.
        self.pg = placement_group([dict(bundle) for _ in range(world)],
                                  strategy="STRICT_PACK" if device == "cuda" else "PACK")
        try:
            try:
                ray.get(self.pg.ready(), timeout=envs.RLK_WORKER_START_TIMEOUT)
            except GetTimeoutError:
                raise WorkerFailed(f"Ray could not place {world} {name} ranks of {bundle} within "
                                   f"{envs.RLK_WORKER_START_TIMEOUT} s") from None
            actor_cls = _rank_actor_class()
            self.actors = [actor_cls.options(**actor_options(self.pg, r, gpus, device)).remote()
                           for r in range(world)]
            try:
                host = ray.get(self.actors[0].address.remote(), timeout=envs.RLK_WORKER_START_TIMEOUT)
                port = ray.get(self.actors[0].free_port.remote(), timeout=envs.RLK_WORKER_START_TIMEOUT)
            except (GetTimeoutError, RayActorError) as exc:
                raise WorkerFailed(f"{name} rank 0 of {world} did not start: {_failure(exc)}") from None
        except BaseException:
            self.close(failed=True)  # no Group holds this yet: its actors and placement go now
            raise
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        if device == "cuda":
            env.update(CUDA_ENV)
        self.setups = [a.setup.remote(r, world, f"tcp://{host}:{port}", factory, args, env, device)
                       for r, a in enumerate(self.actors)]

    def ready(self, timeout: float | None) -> None:
        self.wait(self.setups, timeout)

    def wait(self, refs: list, timeout: float | None) -> list[Any]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        results: dict[int, Any] = {}
        pending = dict(zip(refs, range(self.world)))
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not done:
                raise WorkerFailed(f"{self.name} ranks {sorted(pending.values())} of {self.world} "
                                   f"did not answer within {timeout:.0f} s")
            rank = pending.pop(done[0])
            try:
                results[rank] = ray.get(done[0])
            except (RayTaskError, RayActorError) as exc:
                # The first rank to fail fails the group; the others may be blocked in a
                # collective waiting for it, and are killed on close.
                raise WorkerFailed(f"{self.name} rank {rank} of {self.world} failed: "
                                   f"{_failure(exc)}") from None
        return [results[r] for r in range(self.world)]

    def call(self, method: str, args: tuple, timeout: float | None) -> list[Any]:
        return self.wait([a.call.remote(method, args) for a in self.actors], timeout)

    def close(self, failed: bool) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            if not failed and self.actors:
                ray.get([a.release.remote() for a in self.actors], timeout=60)
        except Exception:  # noqa: BLE001 - the actors are killed below whatever happened
            pass
        finally:
            for a in self.actors:
                ray.kill(a, no_restart=True)
            remove_placement_group(self.pg)
            if not failed:
                _Ray.unsettled -= 1


# -- the group ------------------------------------------------------------------------------------
class Group:
    """Resident ranks of one side; use as a context manager, or close() it."""

    def __init__(self, backend: _Local | _Ray, name: str, timeout: float | None = None):
        self.backend, self.name, self.failed, self.closed = backend, name, False, False
        self.built, self.closing = False, threading.Lock()
        # How long the build may take: start()'s timeout, else RLK_WORKER_START_TIMEOUT.
        self.start_timeout = timeout if timeout is not None else envs.RLK_WORKER_START_TIMEOUT

    def ready(self) -> Group:
        """Waits until every rank has built its object; a failed build fails and stops the group."""
        if self.closed:
            raise InfrastructureError(f"the {self.name} ranks were already stopped")
        if not self.built:
            try:
                self.backend.ready(self.start_timeout)
            except BaseException:
                self.failed = True
                self.close()
                raise
            self.built = True
        return self

    @property
    def world(self) -> int:
        return self.backend.world

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """object.method(*args) on every rank; the results in rank order."""
        if self.closed:
            raise InfrastructureError(f"the {self.name} ranks were already stopped")
        if not self.built:
            raise InfrastructureError(f"the {self.name} ranks were called before ready()")
        try:
            return self.backend.call(method, args, timeout)
        except BaseException:
            self.failed = True
            self.close()
            raise

    def close(self) -> None:
        with self.closing:  # ready_all may stop a group from another thread
            if not self.closed:
                self.closed = True
                self.backend.close(self.failed)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.failed = self.failed or exc_type is not None
        self.close()


def start(factory: Callable[..., Any], world: int, *, args: tuple = (), device: str = "cpu",
          first_gpu: int = 0, name: str = "worker", timeout: float | None = None,
          wait: bool = True) -> Group:
    """Starts `world` ranks that each build factory(rank, world, *args) once, and waits for the
    build (or, with wait=False, leaves that to Group.ready()). On CUDA local rank r takes GPU
    first_gpu + r of this machine (Ray places its ranks itself)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: use cpu or cuda")
    if envs.RLK_LAUNCHER == "ray":
        group = Group(_Ray(factory, world, args, device, name), name, timeout)
    else:
        check_devices(first_gpu + world, device)
        group = Group(_Local(factory, world, args, device, first_gpu, name), name, timeout)
    return group.ready() if wait else group


def ready_all(*groups: Group) -> None:
    """ready() on groups that build at once, waiting on all of them together: the first build to
    fail stops every group (so a failure on one side is not held back by the other's build) and is
    the error raised."""
    failures: list[BaseException] = []

    def wait(group: Group) -> None:
        try:
            group.ready()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            failures.append(exc)
            for other in groups:
                if other is not group and not other.closed:
                    other.failed = True
                    other.close()

    threads = [threading.Thread(target=wait, args=(g,), daemon=True, name=f"ready-{g.name}")
               for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def launch(fn: Callable[..., Any], world: int, *, args: tuple = (), timeout: float | None = None,
           device: str = "cpu", first_gpu: int = 0, name: str = "worker") -> list[Any]:
    """Runs fn(rank, world, *args) once on `world` ranks; returns their results in rank order."""
    with start(_Once, world, args=(fn, args), device=device, first_gpu=first_gpu, name=name,
               timeout=timeout) as group:
        return group.call("run", timeout=timeout)
