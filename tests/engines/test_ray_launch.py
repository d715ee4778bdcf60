"""The Ray launcher against a real local Ray head: ranks are actors in one placement group that form
a gloo group, a rank that raises fails the group promptly naming that rank, and nothing the launch
created (actors, placement group) outlives it.

The launching process is a fresh interpreter, as `rlk run` is: whether Ray can join a loopback-only
head depends on settings read when ray is first imported, which this test session may have done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from rl_engine.distributed import collectives
from rl_engine.engines.launch import cluster_address
from rl_engine.errors import BadInput


# Run as __main__, so Ray sends the rank functions to the actors by value.
DRIVER = r'''
import json, sys, time
from rl_engine.engines.launch import WorkerFailed, launch

def fixed_order_sum(rank, world):
    import os, ray, torch, torch.distributed as dist
    from rl_engine.distributed import collectives
    x = torch.randn(4099, generator=torch.Generator().manual_seed(rank))
    ctx = ray.get_runtime_context()
    return {"sum": collectives.all_reduce(x, None).numpy().tobytes().hex(),
            "backend": dist.get_backend(), "world": dist.get_world_size(), "pid": os.getpid(),
            "placement_group": ctx.get_placement_group_id(), "actor": ctx.get_actor_id()}

def rank_one_raises(rank, world):
    import torch.distributed as dist
    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # waits for rank 1, which never comes: only the launcher can end this rank

fn = {"sum": fixed_order_sum, "raise": rank_one_raises}[sys.argv[1]]
start = time.monotonic()
try:
    out = {"results": launch(fn, 2, timeout=240)}
except WorkerFailed as exc:
    out = {"error": str(exc)}
out["seconds"] = time.monotonic() - start

# Still connected, as a long-lived launcher (a matrix runner) is: a job's placement groups and
# actors die with its driver anyway, so only now does a leak show.
import ray
from ray.util.state import list_actors, list_placement_groups
job, api = ray.get_runtime_context().get_job_id(), sys.argv[2]  # the head's state API
deadline = time.monotonic() + 30
while True:
    groups = [g.state for g in list_placement_groups(api, filters=[("creator_job_id", "=", job)])]
    alive = [a.actor_id for a in list_actors(api, filters=[("job_id", "=", job)]) if a.state != "DEAD"]
    if (groups and all(s == "REMOVED" for s in groups) and not alive) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
out["placement_groups"], out["alive_actors"] = groups, alive
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def head():
    """A fresh 4-CPU head of our own, stopped by its pids (never `ray stop`)."""
    from rl_engine.stack import ray_head

    h = ray_head.start(num_cpus=4)
    try:
        yield h
    finally:
        h.stop()


def launch_under_ray(head, which: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RLK_LAUNCHER="ray", RLK_RAY_ADDRESS=head.gcs_address, RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=head.token_file)  # the head requires it
    proc = subprocess.run([sys.executable, "-c", DRIVER, which, head.address], env=env, capture_output=True,
                          text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def nothing_left(out: dict) -> None:
    """The launch's one placement group is removed and its actors are dead, while its driver lives."""
    assert out["placement_groups"] == ["REMOVED"] and out["alive_actors"] == []


@pytest.mark.slow
def test_two_actor_ranks_in_one_placement_group_sum_to_the_same_bits(head):
    run = launch_under_ray(head, "sum")
    out = run["results"]
    want = collectives.sum_in_order([torch.randn(4099, generator=torch.Generator().manual_seed(r))
                                     for r in range(2)])
    assert [o["sum"] for o in out] == [want.numpy().tobytes().hex()] * 2
    assert [o["backend"] for o in out] == ["gloo", "gloo"] and [o["world"] for o in out] == [2, 2]
    assert out[0]["pid"] != out[1]["pid"] and out[0]["actor"] != out[1]["actor"]
    assert out[0]["placement_group"] is not None
    assert out[0]["placement_group"] == out[1]["placement_group"]
    nothing_left(run)


@pytest.mark.slow
def test_a_rank_that_raises_fails_the_group_promptly_and_leaves_nothing(head):
    out = launch_under_ray(head, "raise")
    assert out["error"].startswith("worker rank 1 of 2 failed: ValueError: rank one cannot go on")
    # Rank 0 would wait in its barrier for gloo's 30-minute default; the launcher does not.
    assert out["seconds"] < 120
    nothing_left(out)


def test_the_jobs_api_address_is_refused_outside_a_job(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RLK_RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(BadInput, match="Jobs API address"):
        cluster_address()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # what Ray sets inside a job
    assert cluster_address() == "auto"
    monkeypatch.setenv("RLK_RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster_address() == "10.0.0.1:6379"


# Two actors placed as CUDA ranks on a head that declares two (fake) GPUs.
GPU_VIEW = r'''
import json, sys
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from rl_engine.engines import launch as ray_launch

ray.init(address=sys.argv[1])
pg = placement_group([{"CPU": 1, "GPU": 1}] * 2, strategy="STRICT_PACK")
ray.get(pg.ready(), timeout=120)
cls = ray_launch._rank_actor_class()
actors = [cls.options(**ray_launch.actor_options(pg, r, 1, "cuda")).remote() for r in range(2)]
print("RESULT " + json.dumps(ray.get([a.gpu.remote() for a in actors], timeout=120)))
remove_placement_group(pg)
'''


@pytest.mark.slow
def test_cuda_ranks_see_every_gpu_and_know_their_own():
    """Ray would hide the peers' GPUs from each CUDA rank, which CUDA IPC cannot map; the actors
    keep the host's view and each takes a different GPU that Ray assigned."""
    from rl_engine.stack import ray_head

    h = ray_head.start(num_cpus=2, num_gpus=2)
    try:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("RAY_") and k != "CUDA_VISIBLE_DEVICES"}
        env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=h.token_file)
        proc = subprocess.run([sys.executable, "-c", GPU_VIEW, h.gcs_address], env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        h.stop()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    views = json.loads(lines[-1].removeprefix("RESULT "))
    assert [visible for visible, _ in views] == [None, None]
    assert sorted(ids[0] for _, ids in views) == [0, 1]


# A stand-in for ray: it registers its exit hook when imported, as ray does, and says whether that
# hook found the driver still connected (and so would wait 0.5 s for late worker logs).
FAKE_RAY_DRIVER = r'''
import atexit, sys, types
ray = types.ModuleType("ray")
ray.connected = False
ray.init = lambda **_: setattr(ray, "connected", True)
ray.is_initialized = lambda: ray.connected
def shutdown():
    print("left at once", flush=True)
    ray.connected = False
ray.shutdown = shutdown
atexit.register(lambda: print("ray's hook waited" if ray.connected else "ray's hook: gone", flush=True))
sys.modules["ray"] = ray
from rl_engine.engines import launch
launch._join("auto")
launch._Ray.unsettled = int(sys.argv[1])
'''


@pytest.mark.parametrize("unsettled, lines", [(0, ["left at once", "ray's hook: gone"]),
                                              (1, ["ray's hook waited"])])
def test_the_driver_leaves_ray_before_its_exit_wait_only_when_every_group_closed_cleanly(
        tmp_path, unsettled, lines):
    """Ray's exit hook waits 0.5 s for the workers' last log lines before it disconnects. The
    launcher disconnects first, from a hook of its own that runs before Ray's, when every rank
    group of the process closed cleanly; while one did not (a failing rank's last words), Ray's
    wait is kept."""
    done = subprocess.run([sys.executable, "-c", FAKE_RAY_DRIVER, str(unsettled)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == lines
