"""One rollout rank: its engine, its TP rank inside that engine, and its share of the samples.

World = engines x tp ranks; rank r serves engine r // tp as TP rank r % tp. Engine e of E takes the
samples whose index in prompt-major order is e modulo E, so the split is fixed by (E, prompts,
n_samples) alone and the samples' seeds do not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.engines.launch import DEVICES, launch, rank_device
from rl_engine.engines.rollout.engine import RolloutEngine, Sample, all_requests
from rl_engine.engines.rollout.kv_cache import POLICIES
from rl_engine.models.config import Qwen3Config
from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.tp import TPGroup
from rl_engine.evidence import layout, records
from rl_engine.runtime import trace_record
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router


@dataclass(kw_only=True, slots=True)
class RolloutJob:
    config: Qwen3Config
    state: dict[str, torch.Tensor]
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

    def __post_init__(self) -> None:
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


def rollout_worker(rank: int, world: int, job: RolloutJob) -> dict[str, Any]:
    """The per-rank function for launch(): returns this rank's samples (tensor-free) and records."""
    if world != job.world:
        raise ValueError(f"launched {world} ranks for {job.engines} engines x TP {job.tp}")
    engine_index = rank // job.tp
    tp = _tp_group(rank, job)  # every rank creates every group, in the same order
    router = Router(job.plan, side="rollout", engine="builtin", device=rank_device(job.device))
    model = Qwen3(job.config, router, tp)
    engine = RolloutEngine(model, router, tp, max_batch=job.max_batch, page_policy=job.page_policy)
    engine.load_weights(job.state)
    requests = engine_requests(len(job.prompts), job.n_samples, engine_index, job.engines)
    with trace_record.record(job.trace_dir, name=f"rollout-rank{rank}"):
        samples = engine.generate(job.prompts, job.n_samples, job.max_new_tokens, job.seed,
                                  requests=requests)
    if job.run_dir is not None:
        records.write_readback(layout.RunDir(job.run_dir), router, run_id=job.run_id, rank=rank,
                               world_size=world, step=job.step,
                               extra={"engine_index": engine_index, "tp_rank": tp.rank,
                                      "tp_size": tp.size, "samples": len(samples), **job.extra})
    return {"rank": rank, "engine": engine_index, "tp_rank": tp.rank,
            "samples": [s.plain() for s in samples], "records": router.module_records(),
            "weights_checksum": engine.weights_checksum()}


def run_rollout(job: RolloutJob, *,
                timeout: float | None = None) -> tuple[list[Sample], list[dict]]:
    """Runs the job's ranks; returns every sample in prompt-major order and each rank's result.
    The TP ranks of an engine must agree on every token and log-prob bit."""
    results = launch(rollout_worker, job.world, args=(job,), timeout=timeout, device=job.device,
                     first_gpu=job.first_gpu)
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
    order = all_requests(len(job.prompts), job.n_samples)
    return [Sample.from_plain(merged[k]) for k in order], results
