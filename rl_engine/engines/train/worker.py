"""The per-rank function that `launch` runs: build a trainer, take its steps, report the results.

Every rank gets the same jobs (model config, full Hugging Face state dict, samples, plan, layout)
and runs them in order, so one process group can compare several layouts of the same world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl_engine.engines.train.packing import Sample
from rl_engine.engines.train.trainer import TrainConfig, Trainer
from rl_engine.models.config import Qwen3Config
from rl_engine.runtime.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainJob:
    model_config: Qwen3Config
    state: dict[str, torch.Tensor]
    samples: list[Sample]
    config: TrainConfig = field(default_factory=TrainConfig)
    plan: Plan = field(default_factory=Plan)
    steps: int = 1
    return_state: bool = False  # also return the full weights and the last step's reduced grads


def run_job(job: TrainJob) -> dict:
    trainer = Trainer(job.model_config, job.state, job.plan, job.config)
    before = trainer.checksum()
    results = [trainer.step(job.samples) for _ in range(job.steps)]
    out = {
        "logps": results[0].logps,
        "loss": [r.loss for r in results],
        "rewards": results[0].rewards,
        "micro_batches": [r.micro_batches for r in results],
        "checksum_before": before,
        "checksum": trainer.checksum(),
        "master_checksum": trainer.checksum("master"),
        "routes": trainer.router.module_records(),
    }
    if job.return_state:
        out["weights"] = trainer.full_state_dict("weights")
        out["grads"] = trainer.full_state_dict("grads")
    return out


def train_worker(rank: int, world: int, jobs: list[TrainJob]) -> list[dict]:
    """launch(train_worker, world, args=(jobs,)): each job's results on this rank."""
    del rank, world  # the layout reads them from the process group
    return [run_job(job) for job in jobs]
