"""Layout and workload of a step, from flags and the runbook variables users already set.

Values a layout cannot honour are refused with a one-line BadInput (exit code 2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rl_engine import envs
from rl_engine.errors import BadInput

WORKLOADS: dict[str, dict[str, int]] = {
    # The runbook's: 1 prompt, 2 samples, 128 new tokens, TP=2, CP=2, 2 rollout engines of TP=2.
    "default": dict(tp=2, cp=2, actor_gpus=4, rollout_gpus=4, rollout_gpus_per_engine=2,
                    rollout_batch_size=1, n_samples_per_prompt=2, max_response_len=128,
                    max_tokens_per_gpu=512),
    # Fewer tokens and ranks, for repeated tests.
    "ci": dict(tp=2, cp=1, actor_gpus=2, rollout_gpus=2, rollout_gpus_per_engine=2,
               rollout_batch_size=1, n_samples_per_prompt=2, max_response_len=32,
               max_tokens_per_gpu=256),
}

_ENV = {"tp": "TP_SIZE", "cp": "CP_SIZE", "actor_gpus": "ACTOR_GPUS", "rollout_gpus": "ROLLOUT_GPUS",
        "rollout_gpus_per_engine": "ROLLOUT_GPUS_PER_ENGINE",
        "rollout_batch_size": "ROLLOUT_BATCH_SIZE", "n_samples_per_prompt": "N_SAMPLES_PER_PROMPT",
        "max_response_len": "MAX_RESPONSE_LEN", "max_tokens_per_gpu": "MAX_TOKENS_PER_GPU"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepConfig:
    tp: int
    cp: int
    actor_gpus: int
    rollout_gpus: int
    rollout_gpus_per_engine: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    max_response_len: int
    max_tokens_per_gpu: int
    steps: int = 1
    seed: int = 0
    device: str = "cpu"
    # Training and rollout on the same GPUs, one after the other (colocated), or rollout on the
    # ROLLOUT_GPUS after the trainer's ACTOR_GPUS.
    colocate: bool = True
    # The engine ids of each side (recorded in the manifest and named in every readback file).
    trainer: str = "builtin"
    rollout_engine: str = "builtin"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and f.name != "seed" and value < 1:
                raise BadInput(f"{_ENV.get(f.name, f.name)}={value} must be at least 1")
        if self.actor_gpus % (self.tp * self.cp):
            raise BadInput(f"ACTOR_GPUS={self.actor_gpus} is not a multiple of TP_SIZE x CP_SIZE = "
                           f"{self.tp} x {self.cp}; set ACTOR_GPUS = TP x CP x DP")
        if self.rollout_gpus % self.rollout_gpus_per_engine:
            raise BadInput(f"ROLLOUT_GPUS={self.rollout_gpus} is not a multiple of "
                           f"ROLLOUT_GPUS_PER_ENGINE={self.rollout_gpus_per_engine}")
        if self.global_batch_size % self.dp:
            raise BadInput(f"GLOBAL_BATCH_SIZE={self.global_batch_size} sequences cannot be split "
                           f"over DP={self.dp} replicas; change ACTOR_GPUS or the batch")
        from rl_engine.engines.interface import ROLLOUT_ENGINES, TRAINERS, missing_package

        for flag, side, value, known in (("--trainer", "training", self.trainer, TRAINERS),
                                         ("--rollout-engine", "rollout", self.rollout_engine,
                                          ROLLOUT_ENGINES)):
            if value not in known:
                raise BadInput(f"{flag} {value!r}: use one of {', '.join(known)}")
            if (why := missing_package(side, value)) is not None:
                raise BadInput(f"{flag} {value}: {why}")
        if self.tp != self.rollout_gpus_per_engine:
            # Each TP rank rounds its row-parallel partial to bf16 before the fixed-order sum, so
            # the bits of a TP=2 engine are not those of a TP=1 trainer: parity holds per TP size.
            raise BadInput(f"TP_SIZE={self.tp} differs from ROLLOUT_GPUS_PER_ENGINE="
                           f"{self.rollout_gpus_per_engine}: the trainer and the rollout engines "
                           "compute the same bits only at the same TP size; set them equal")
        if self.device not in ("cpu", "cuda"):
            raise BadInput(f"device {self.device!r}: use cpu or cuda")

    @property
    def dp(self) -> int:
        return self.actor_gpus // (self.tp * self.cp)

    @property
    def gpus(self) -> int:
        """GPUs of this machine the layout takes on CUDA."""
        if self.colocate:
            return max(self.actor_gpus, self.rollout_gpus)
        return self.actor_gpus + self.rollout_gpus

    @property
    def rollout_first_gpu(self) -> int:
        return 0 if self.colocate else self.actor_gpus

    @property
    def engines(self) -> int:
        return self.rollout_gpus // self.rollout_gpus_per_engine

    @property
    def global_batch_size(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def numel_per_step(self) -> int:
        return self.global_batch_size * self.max_response_len

    def as_dict(self) -> dict:
        body = dataclasses.asdict(self)
        body.update(dp=self.dp, engines=self.engines, gpus=self.gpus, global_batch_size=self.global_batch_size,
                    numel_per_step=self.numel_per_step)
        return body

    @classmethod
    def resolve(cls, workload: str = "default", **overrides) -> StepConfig:
        """Workload preset, then runbook variables, then explicit overrides (flags)."""
        if workload not in WORKLOADS:
            raise BadInput(f"workload {workload!r} is not one of {', '.join(WORKLOADS)}")
        values: dict = dict(WORKLOADS[workload])
        for field, var in _ENV.items():
            env_value = getattr(envs, var)
            if env_value is not None:
                values[field] = env_value
        values.update(trainer=envs.RLK_TRAINER, rollout_engine=envs.RLK_ROLLOUT_ENGINE)
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        gbs = envs.GLOBAL_BATCH_SIZE
        if gbs is not None and gbs != config.global_batch_size:
            raise BadInput(f"GLOBAL_BATCH_SIZE={gbs} differs from ROLLOUT_BATCH_SIZE x "
                           f"N_SAMPLES_PER_PROMPT = {config.global_batch_size}")
        return config


def default_model_root() -> Path:
    return envs.RLK_STATE_DIR / "models" / "tiny"
