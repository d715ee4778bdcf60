"""The built-in rollout engine: paged KV cache, continuous batching, TP, several engines."""

from rl_engine.engines.rollout.engine import RolloutEngine, Sample
from rl_engine.models.unshard import full_state, state_checksum
from rl_engine.engines.rollout.worker import (RolloutJob, RolloutRank, merge_samples, rollout_worker,
                                              run_rollout)

__all__ = ["RolloutEngine", "RolloutJob", "RolloutRank", "Sample", "full_state", "merge_samples",
           "rollout_worker", "run_rollout", "state_checksum"]
