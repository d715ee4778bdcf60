"""rl-engine: deterministic, batch-invariant operators and the evidence that an RL trainer and its
rollout engine compute bitwise identical token log-probabilities."""

__version__ = "0.1.0"
