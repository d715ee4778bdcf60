"""One rank of the built-in trainer, resident for a whole run: the trainer side of the engine
interface (rl_engine/engines/interface.py).

Every rank builds its shard of the model from the checkpoint folder once, then keeps its fp32
master weights, AdamW moments and step counter across the run's steps. After each step rank 0
publishes the updated full weights for the rollout ranks (rl_engine/engines/sync.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_engine.engines import sync
from rl_engine.engines.train.packing import Sample
from rl_engine.engines.train.trainer import TrainConfig, Trainer
from rl_engine.evidence import layout, records
from rl_engine.models import checkpoint
from rl_engine.runtime import trace_record
from rl_engine.runtime.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSpec:
    model_root: Path
    plan: Plan
    config: TrainConfig
    run_dir: Path
    run_id: str
    sync_dir: Path                   # where rank 0 publishes the weights after each step
    trace_dir: Path | None = None


class TrainerRank:
    engine_id = "builtin"

    def __init__(self, rank: int, world: int, spec: TrainerSpec):
        self.rank, self.world, self.spec = rank, world, spec
        config = checkpoint.load_config(spec.model_root)
        self.trainer = Trainer(config, checkpoint.load_state(spec.model_root), spec.plan, spec.config)

    def train_step(self, samples: list[Sample], step: int) -> dict[str, Any]:
        """Recomputes the samples' log-probs, takes one optimizer step, writes this rank's readback;
        rank 0 returns the log-probs (fp32, CPU) and the loss."""
        t0 = time.monotonic()
        with trace_record.record(self.spec.trace_dir, name=f"training-rank{self.rank}-step{step}"):
            result = self.trainer.step(samples)
        seconds = round(time.monotonic() - t0, 4)
        self.readback(step, micro_batches=result.micro_batches)
        out: dict[str, Any] = {"rank": self.rank, "loss": result.loss, "seconds": seconds,
                               "optimizer_steps": self.trainer.steps}
        if self.rank == 0:
            out["logps"] = [t.float().cpu() for t in result.logps]
        return out

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor] | None:
        """The samples' log-probs under the current weights, without a step (rank 0's)."""
        logps = self.trainer.logprobs(samples)
        return [t.float() for t in logps] if self.rank == 0 else None

    def weights_for_sync(self) -> dict[str, torch.Tensor]:
        """The bf16 weights under Hugging Face names, gathered over TP (a collective)."""
        return self.trainer.full_state_dict("weights")

    def publish(self, step: int) -> sync.Published | str:
        """Rank 0 writes the updated weights for the rollout ranks and returns where and their
        digests; every other rank returns the combined digest of the weights it gathered, which
        must be rank 0's (DP replicas that drifted apart would show here)."""
        state = self.weights_for_sync()
        if self.rank != 0:
            return sync.combined(sync.digests(state))
        # CUDA IPC shares these very tensors: they stay referenced until the next publish, by
        # when every rollout rank has copied them.
        self._shared = state
        return sync.publish(state, self.spec.sync_dir, step)

    def readback(self, step: int, **extra: Any) -> Path:
        lay = self.trainer.layout
        return records.write_readback(
            layout.RunDir(self.spec.run_dir), self.trainer.router, run_id=self.spec.run_id,
            rank=self.rank, world_size=self.world, step=step,
            extra={"tp_rank": lay.tp_rank, "cp_rank": lay.cp_rank, "dp_rank": lay.dp_rank,
                   "gradient_reduction": self.trainer.gradient_reduction(), **extra})
