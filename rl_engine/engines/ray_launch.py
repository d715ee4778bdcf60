"""The Ray form of the launcher: one actor per rank in a placement group (one bundle per rank, a
GPU per bundle on CUDA). The ranks still form a torch.distributed group among themselves; Ray
only places them. Used when RLK_LAUNCHER=ray, with the cluster at RLK_RAY_ADDRESS (host:port of its
GCS, or ray://host:port), or the one this process is already connected to, e.g. inside a Ray job.

The actors and the placement group live exactly as long as one launch: they are killed and removed
when it returns or fails, so a failed group leaves nothing holding the cluster's CPUs or GPUs.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Callable

from rl_engine import envs
from rl_engine.engines.launch import CUDA_ENV, WorkerFailed
from rl_engine.errors import BadInput, InfrastructureError

# Settings of the launching process that its ranks need too (actors start with the cluster's
# environment, not the driver's).
FORWARDED_ENV = ("RLK_RUN_LOG",)
# Ray shows a GPU actor only its own GPU (CUDA_VISIBLE_DEVICES). The CUDA IPC collectives map the
# peers' buffers, which needs the peers' GPUs visible, so CUDA ranks keep the host's view and take
# the GPU Ray assigned them.
KEEP_ALL_GPUS = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


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
            from rl_engine.engines.launch import free_port

            return free_port()

        def run(self, rank: int, world: int, init: str, fn: Callable, args: tuple,
                env: dict[str, str], device: str = "cpu") -> Any:
            import torch
            import torch.distributed as dist

            from rl_engine.engines.launch import _log_to_run_log, init_rank, to_cpu

            os.environ.update(env)
            torch.set_num_threads(1)
            _log_to_run_log()
            init_rank(rank, world, init, device,
                      local_rank=self.gpu()[1][0] if device == "cuda" else 0)
            out = fn(rank, world, *args)
            if device == "cuda":
                out = to_cpu(out)
                from rl_engine.distributed import cuda_ipc

                cuda_ipc.release()
            # Only on success: a failed rank keeps its connections open until the launcher kills
            # it, so its peers do not fail first on a closed connection and hide the cause.
            dist.destroy_process_group()
            return out

    return RankActor


def _failure(exc: Exception) -> str:
    """The remote error as `Type: message` and its traceback, without Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        tb = getattr(exc, "traceback_str", "")
        return f"{type(cause).__name__}: {cause}\n{tb}".rstrip()
    return f"{type(exc).__name__}: {exc}"


def actor_options(pg, bundle: int, gpus_per_rank: float, device: str) -> dict[str, Any]:
    """Where and how the actor of one rank starts: its bundle of the launch's placement group, and
    on CUDA the host's whole GPU view (KEEP_ALL_GPUS)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle),
        "num_cpus": 1, "num_gpus": gpus_per_rank}
    if device == "cuda":
        options["runtime_env"] = {"env_vars": dict(KEEP_ALL_GPUS)}
    return options


def launch_ray(fn: Callable[..., Any], world: int, *, args: tuple = (), timeout: float | None = None,
               gpus_per_rank: float = 0, device: str = "cpu") -> list[Any]:
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        _join(cluster_address())  # before any ray import of ours: see _join
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": 1, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    # CUDA ranks share memory over IPC, which only works between the GPUs of one host.
    pg = placement_group([dict(bundle) for _ in range(world)],
                         strategy="STRICT_PACK" if device == "cuda" else "PACK")
    actors = []
    try:
        try:
            ray.get(pg.ready(), timeout=envs.RLK_WORKER_START_TIMEOUT)
        except GetTimeoutError:
            raise WorkerFailed(f"Ray could not place {world} ranks of {bundle} within "
                               f"{envs.RLK_WORKER_START_TIMEOUT} s") from None
        actor_cls = _rank_actor_class()
        actors = [actor_cls.options(**actor_options(pg, r, gpus_per_rank, device)).remote()
                  for r in range(world)]
        try:
            host = ray.get(actors[0].address.remote(), timeout=envs.RLK_WORKER_START_TIMEOUT)
            port = ray.get(actors[0].free_port.remote(), timeout=envs.RLK_WORKER_START_TIMEOUT)
        except (GetTimeoutError, RayActorError) as exc:
            raise WorkerFailed(f"rank 0 of {world} did not start: {_failure(exc)}") from None
        init = f"tcp://{host}:{port}"
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        if device == "cuda":
            env.update(CUDA_ENV)
        refs = [a.run.remote(r, world, init, fn, args, env, device) for r, a in enumerate(actors)]
        results: dict[int, Any] = {}
        pending = dict(zip(refs, range(world)))
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not done:
                raise WorkerFailed(f"ranks {sorted(pending.values())} of {world} did not finish "
                                   f"within {timeout:.0f} s")
            rank = pending.pop(done[0])
            try:
                results[rank] = ray.get(done[0])
            except (RayTaskError, RayActorError) as exc:
                # The first rank to fail fails the group; the others may be blocked in a
                # collective waiting for it, and are killed below.
                raise WorkerFailed(f"rank {rank} of {world} failed: {_failure(exc)}") from None
        return [results[r] for r in range(world)]
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
