"""The training side of one step, as the per-rank function of the launcher.

Each rank builds its trainer shard, recomputes the log-probs of the rollout's tokens, takes the
GRPO step and writes its own readback; rank 0 also returns the updated full weights (the weight
sync payload) and their checksum. Everything returned is on the CPU, whatever the rank's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_engine.engines.train.packing import Sample
from rl_engine.engines.train.trainer import TrainConfig, Trainer
from rl_engine.models.config import Qwen3Config
from rl_engine.evidence import layout, records
from rl_engine.runtime import trace_record
from rl_engine.runtime.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStep:
    model_config: Qwen3Config
    state: dict[str, torch.Tensor]
    plan: Plan
    samples: list[Sample]
    config: TrainConfig
    run_dir: Path
    run_id: str
    step: int
    trace_dir: Path | None = None


def train_step_worker(rank: int, world: int, job: TrainStep) -> dict[str, Any]:
    trainer = Trainer(job.model_config, job.state, job.plan, job.config)
    with trace_record.record(job.trace_dir, name=f"training-rank{rank}"):
        result = trainer.step(job.samples)
    lay = trainer.layout
    records.write_readback(layout.RunDir(job.run_dir), trainer.router, run_id=job.run_id, rank=rank,
                           world_size=world, step=job.step,
                           extra={"tp_rank": lay.tp_rank, "cp_rank": lay.cp_rank,
                                  "dp_rank": lay.dp_rank, "micro_batches": result.micro_batches})
    state = trainer.full_state_dict("weights")  # a collective: every rank takes part
    out: dict[str, Any] = {"rank": rank, "loss": result.loss, "rewards": result.rewards,
                           "checksum": trainer.checksum()}
    if rank == 0:
        out["logps"] = [t.float().cpu() for t in result.logps]
        out["state"] = {name: t.cpu() for name, t in state.items()}
    return out
