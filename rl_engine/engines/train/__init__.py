"""Megatron-style TP x CP x DP trainer: packed micro-batches, GRPO loss, fixed-order gradients."""

from rl_engine.engines.train.packing import Sample
from rl_engine.engines.train.trainer import StepResult, TrainConfig, Trainer
from rl_engine.engines.train.worker import TrainJob, train_worker

__all__ = ["Sample", "StepResult", "TrainConfig", "TrainJob", "Trainer", "train_worker"]
