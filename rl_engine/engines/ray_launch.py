"""The Ray form of the launcher: one actor per rank in a placement group (one bundle per rank, a
GPU per bundle on CUDA). The ranks still form a torch.distributed group among themselves; Ray
only places them. Used when RLK_LAUNCHER=ray, with the cluster at RLK_RAY_ADDRESS (or the one this
process is already connected to, e.g. inside a Ray job).
"""

from __future__ import annotations

from typing import Any, Callable

from rl_engine import envs
from rl_engine.engines.launch import WorkerFailed


def _rank_actor_class():
    import ray

    @ray.remote(max_restarts=0)
    class RankActor:
        def address(self) -> str:
            return ray.util.get_node_ip_address()

        def free_port(self) -> int:
            from rl_engine.engines.launch import free_port

            return free_port()

        def run(self, rank: int, world: int, init: str, fn: Callable, args: tuple) -> Any:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
            try:
                return fn(rank, world, *args)
            finally:
                dist.destroy_process_group()

    return RankActor


def launch_ray(fn: Callable[..., Any], world: int, *, args: tuple = (), timeout: float | None = None,
               gpus_per_rank: float = 0) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=envs.RLK_RAY_ADDRESS or "auto", log_to_driver=True)
    bundle = {"CPU": 1, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    actors = []
    try:
        try:
            ray.get(pg.ready(), timeout=envs.RLK_WORKER_START_TIMEOUT)
        except GetTimeoutError:
            raise WorkerFailed(f"Ray could not place {world} ranks of {bundle} within "
                               f"{envs.RLK_WORKER_START_TIMEOUT} s") from None
        actor_cls = _rank_actor_class()
        actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=r), num_cpus=1,
            num_gpus=gpus_per_rank).remote() for r in range(world)]
        host = ray.get(actors[0].address.remote())
        port = ray.get(actors[0].free_port.remote())
        init = f"tcp://{host}:{port}"
        refs = [a.run.remote(r, world, init, fn, args) for r, a in enumerate(actors)]
        results: dict[int, Any] = {}
        pending = dict(zip(refs, range(world)))
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not done:
                raise WorkerFailed(f"ranks {sorted(pending.values())} did not finish within {timeout} s")
            ref = done[0]
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except (RayTaskError, RayActorError) as exc:
                raise WorkerFailed(f"rank {rank} of {world} failed: {exc}") from None
        return [results[r] for r in range(world)]
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
