"""One rollout rank of the built-in engine, resident for a whole run: its engine, its TP rank
inside that engine, and its share of the samples of every step.

World = engines x tp ranks; rank r serves engine r // tp as TP rank r % tp. Engine e of E takes the
samples whose index in prompt-major order is e modulo E, so the split is fixed by (E, prompts,
n_samples) alone and the samples' seeds do not depend on it. `RolloutRank` is the rollout side of
the engine interface (rl_engine/engines/interface.py); `run_rollout` is one step of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.engines import sync
from rl_engine.evidence import layout, records
from rl_engine.engines.launch import DEVICES, rank_device, start
from rl_engine.engines.rollout.engine import RolloutEngine, Sample, all_requests
from rl_engine.engines.rollout.kv_cache import POLICIES
from rl_engine.models import checkpoint
from rl_engine.models.config import Qwen3Config
from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.tp import TPGroup
from rl_engine.runtime import trace_record
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router


@dataclass(kw_only=True, slots=True)
class RolloutJob:
    """What the rollout ranks are built from, and the samples of one step. The weights come from
    `state`, or, in a run, from the checkpoint folder `model_root`, which each rank reads itself."""
    config: Qwen3Config
    state: dict[str, torch.Tensor] | None
    plan: Plan
    prompts: list[list[int]]
    n_samples: int
    max_new_tokens: int
    seed: int
    engines: int = 1
    tp: int = 1
    max_batch: int = 8
    page_policy: str = "fragmented"
    run_dir: Path | None = None      # where readbacks go (with run_id); None writes none
    run_id: str | None = None
    step: int = 0                    # the run's step this rollout serves (readbacks count per step)
    trace_dir: Path | None = None    # record a torch.profiler trace of each rank there
    device: str = "cpu"              # cpu, or cuda: one GPU per rank
    first_gpu: int = 0               # on CUDA rank r takes GPU first_gpu + r
    extra: dict[str, Any] = field(default_factory=dict)
    model_root: Path | None = None

    def __post_init__(self) -> None:
        if (self.state is None) == (self.model_root is None):
            raise ValueError("give the weights as state or as model_root, one of them")
        if self.engines < 1 or self.tp < 1:
            raise ValueError(f"engines={self.engines} and tp={self.tp} must be at least 1")
        total = len(self.prompts) * self.n_samples
        if self.engines > total:
            raise ValueError(f"{self.engines} engines for {total} samples: an engine would be idle")
        if self.page_policy not in POLICIES:
            raise ValueError(f"page_policy={self.page_policy!r}; use one of {', '.join(POLICIES)}")
        if (self.run_dir is None) != (self.run_id is None):
            raise ValueError("run_dir and run_id go together")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}; use one of {', '.join(DEVICES)}")
        self.config.check_tp(self.tp)

    @property
    def world(self) -> int:
        return self.engines * self.tp


def engine_requests(num_prompts: int, n_samples: int, engine: int,
                    engines: int) -> list[tuple[int, int]]:
    return [r for i, r in enumerate(all_requests(num_prompts, n_samples)) if i % engines == engine]


def _tp_group(rank: int, job: RolloutJob) -> TPGroup:
    if job.tp == 1:
        return TPGroup()
    groups = [dist.new_group(list(range(e * job.tp, (e + 1) * job.tp))) for e in range(job.engines)]
    return TPGroup(rank=rank % job.tp, size=job.tp, group=groups[rank // job.tp])


class RolloutRank:
    """One rank of the built-in rollout engine behind the engine interface."""

    engine_id = "builtin"

    def __init__(self, rank: int, world: int, job: RolloutJob):
        if world != job.world:
            raise ValueError(f"launched {world} ranks for {job.engines} engines x TP {job.tp}")
        self.rank, self.world, self.job = rank, world, job
        self.engine_index = rank // job.tp
        self.tp = _tp_group(rank, job)  # every rank creates every group, in the same order
        self.router = Router(job.plan, side="rollout", engine=self.engine_id,
                             device=rank_device(job.device))
        self.engine = RolloutEngine(Qwen3(job.config, self.router, self.tp), self.router, self.tp,
                                    max_batch=job.max_batch, page_policy=job.page_policy)
        state = job.state if job.state is not None else checkpoint.load_state(job.model_root)
        self.engine.load_weights(state)
        self.digests = sync.digests(state)

    def generate(self, prompts: list[list[int]], n_samples: int, max_new_tokens: int, seed: int,
                 step: int) -> dict[str, Any]:
        """This rank's engine's samples of one step (tensor-free), its readback written."""
        job = self.job
        requests = engine_requests(len(prompts), n_samples, self.engine_index, job.engines)
        name = f"rollout-rank{self.rank}-step{step}"
        with trace_record.record(job.trace_dir, name=name):
            samples = self.engine.generate(prompts, n_samples, max_new_tokens, seed,
                                           requests=requests)
        self.readback(step, samples=len(samples))
        return {"rank": self.rank, "engine": self.engine_index, "tp_rank": self.tp.rank,
                "samples": [s.plain() for s in samples], "records": self.router.module_records()}

    def load_weights(self, published: sync.Published) -> dict[str, Any]:
        """Maps the trainer's published weights, checks every tensor's digest, loads this rank's
        shard; returns the combined digest and what it cost."""
        state, seconds = sync.receive(published)
        t0 = time.monotonic()
        self.engine.load_weights(state)
        self.digests = published.digests
        return {"rank": self.rank, "checksum": sync.combined(self.digests),
                "seconds": {**seconds, "load": round(time.monotonic() - t0, 4)}}

    def weights_checksum(self) -> str:
        """The combined digest of the weights this rank last loaded."""
        return sync.combined(self.digests)

    def readback(self, step: int, **extra: Any) -> Path | None:
        job = self.job
        if job.run_dir is None:
            return None
        return records.write_readback(
            layout.RunDir(job.run_dir), self.router, run_id=job.run_id, rank=self.rank,
            world_size=self.world, step=step,
            extra={"engine_index": self.engine_index, "tp_rank": self.tp.rank,
                   "tp_size": self.tp.size, **extra, **job.extra})


def rollout_worker(rank: int, world: int, job: RolloutJob) -> dict[str, Any]:
    """One step of one rank, for launch(): its samples (tensor-free) and records."""
    return RolloutRank(rank, world, job).generate(job.prompts, job.n_samples, job.max_new_tokens,
                                                  job.seed, job.step)


def run_rollout(job: RolloutJob, *,
                timeout: float | None = None) -> tuple[list[Sample], list[dict]]:
    """Runs the job's ranks; returns every sample in prompt-major order and each rank's result.
    The TP ranks of an engine must agree on every token and log-prob bit."""
    with start(RolloutRank, job.world, args=(job,), device=job.device, first_gpu=job.first_gpu,
               name="rollout", timeout=timeout) as group:
        results = group.call("generate", job.prompts, job.n_samples, job.max_new_tokens, job.seed,
                             job.step, timeout=timeout)
    return merge_samples(results), results


def merge_samples(results: list[dict]) -> list[Sample]:
    """Every engine's samples in prompt-major order, from the ranks' results. The TP ranks of an
    engine must agree on every token and log-prob bit."""
    merged: dict[tuple[int, int], dict] = {}
    for res in results:
        for s in res["samples"]:
            key = (s["prompt_index"], s["sample_index"])
            if res["tp_rank"] == 0:
                merged[key] = s
    for res in results:
        for s in res["samples"]:
            if merged[(s["prompt_index"], s["sample_index"])] != s:
                raise RuntimeError(f"TP rank {res['tp_rank']} of engine {res['engine']} disagrees "
                                   f"on sample {(s['prompt_index'], s['sample_index'])}")
    return [Sample.from_plain(merged[k]) for k in sorted(merged)]  # prompt-major
