"""The engine interface: what the RL loop asks of a rollout engine and of a trainer, one rank each.

The built-in engines implement it (`RolloutRank`, `TrainerRank`); the real vLLM and Megatron-core
adapters implement the same methods, so `rlk run --rollout-engine` / `--trainer` swap them without
touching the loop. Every rank is resident: built once per run by the launcher
(rl_engine/engines/launch.py), then called once or more per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the engine ids are read by the step's settings, which must not import torch
    import torch

    from rl_engine.engines.sync import Published

ROLLOUT_ENGINES: tuple[str, ...] = ("builtin",)
TRAINERS: tuple[str, ...] = ("builtin",)


class RolloutEngine(Protocol):
    engine_id: str

    def generate(self, prompts: list[list[int]], n_samples: int, max_new_tokens: int, seed: int,
                 step: int) -> dict[str, Any]:
        """This rank's samples of one step: exactly max_new_tokens tokens each (EOS ignored),
        temperature 1, each sequence seeded on its own; with the sampled tokens' fp32 log-probs.
        Writes this rank's readback for the step."""

    def load_weights(self, published: Published) -> dict[str, Any]:
        """Loads the trainer's published weights, each tensor checked against its digest;
        returns {"checksum": combined digest, "seconds": {...}}."""

    def weights_checksum(self) -> str:
        """The combined digest of the weights this rank holds."""

    def readback(self, step: int, **extra: Any) -> Path | None:
        """Writes what this rank executed, through rl_engine.evidence."""


class Trainer(Protocol):
    engine_id: str

    def logprobs(self, samples: list[Any]) -> list[torch.Tensor] | None:
        """The samples' fp32 log-probs under the current weights, no update (rank 0's)."""

    def train_step(self, samples: list[Any], step: int) -> dict[str, Any]:
        """Forward, backward and optimizer step over the samples; the optimizer state persists
        from step to step. Rank 0 returns the recomputed log-probs and the loss."""

    def weights_for_sync(self) -> dict[str, torch.Tensor]:
        """The updated weights under Hugging Face names (a collective over the trainer's ranks)."""

    def publish(self, step: int) -> Published | None:
        """Rank 0 hands the updated weights to the rollout ranks (without the launching
        process); returns what they need to find and check them."""

    def readback(self, step: int, **extra: Any) -> Path:
        """Writes what this rank executed, through rl_engine.evidence."""
