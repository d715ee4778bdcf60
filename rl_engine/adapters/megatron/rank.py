"""One rank of the Megatron-core trainer, resident for a whole run: the trainer side of the engine
interface (rl_engine/engines/interface.py) over a Megatron GPTModel.

Each rank initialises Megatron's parallel state (TP x CP x DP, Megatron's rank order: TP fastest,
then CP, then DP, the built-in trainer's order too) in the process group the launcher opened, builds
its GPTModel shard from the Hugging Face folder once, and keeps its fp32 master weights, AdamW
moments and step counter across the run's steps. The step itself (packing, CP chunks, GRPO loss,
gradient accumulation and reduction, AdamW) is the built-in trainer's, so the two trainers differ
only in the model they run; rank 0 hands the updated weights to the rollout ranks in Hugging Face
layout.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.adapters.megatron import ddp, parallel
from rl_engine.adapters.megatron.model import RoutedGPTModel
from rl_engine.adapters.megatron.weights import load_hf, megatron_to_hf
from rl_engine.engines.launch import rank_device
from rl_engine.engines.train import loss
from rl_engine.engines.train.context_parallel import RowOrderedRouter
from rl_engine.engines.train.rank import TrainerRank, TrainerSpec
from rl_engine.engines.train.trainer import TrainConfig, Trainer
from rl_engine.errors import BadInput
from rl_engine.models import checkpoint
from rl_engine.models.config import Qwen3Config
from rl_engine.models.tp import TPGroup
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router

ENGINE = "megatron"


class MegatronTrainer(Trainer):
    """The built-in trainer's step over a Megatron GPTModel (Megatron's parameter names)."""

    head_name = "output_layer.weight"
    qk_norm_names = ("q_layernorm.weight", "k_layernorm.weight")

    def __init__(self, model_config: Qwen3Config, state: dict[str, torch.Tensor], plan: Plan,
                 config: TrainConfig, *, reward_fn: loss.RewardFn = loss.even_token_reward):
        self.config, self.reward_fn = config, reward_fn
        self.layout = lay = parallel.initialise(config.tp, config.cp, config.dp)
        router_cls = RowOrderedRouter if config.cp > 1 else Router
        self.router = router_cls(plan, side="training", engine=ENGINE,
                                 device=rank_device(config.device))
        self.device = self.router.device
        model_config.check_tp(config.tp)
        checkpoint.check_state(model_config, state, "the checkpoint")
        self.model = RoutedGPTModel(model_config, self.router,
                                    TPGroup(lay.tp_rank, lay.tp, lay.tp_group), config.cp)
        load_hf(self.model, state)
        self.model.train()
        self.set_attention(model_config)
        self.start_optimizer()
        self.ddp = ddp.wrap(self.model) if self.gradient_reduction() == ddp.BACKEND else None

    def gradient_reduction(self) -> str:
        """Megatron's own DDP sums the gradients when every training route is P, on CUDA, where
        its buffers live; on the CPU the process group's all-reduce does (the built-in rule)."""
        if not self.router.any_r() and self.device.type == "cuda":
            return ddp.BACKEND
        return super().gradient_reduction()

    def _accumulate(self, main: dict[str, torch.Tensor]) -> None:
        # Under DDP each parameter's gradient hook has already added it to its fp32 main_grad.
        if self.ddp is None:
            super()._accumulate(main)

    def _reduce(self, main: dict[str, torch.Tensor]) -> None:
        if self.ddp is None:
            return super()._reduce(main)
        ddp.sum_over_dp_cp(self.ddp, self.params, main, skip=self._not_counted_here())
        self._sum_qk_norms_over_tp(main)

    def full_state_dict(self, which: str = "weights") -> dict[str, torch.Tensor]:
        """Hugging Face-named full tensors, TP shards gathered (see Trainer.full_state_dict)."""
        source = {"weights": {n: p.detach() for n, p in self.params.items()},
                  "master": self.master, "grads": self.grads}[which]
        return megatron_to_hf(self.model, source)


class MegatronRank(TrainerRank):
    """The built-in trainer rank's calls (train_step, logprobs, weights_for_sync, publish,
    readback) over a MegatronTrainer; its readbacks carry the engine id megatron."""

    engine_id = ENGINE

    @staticmethod
    def refuse(plan: Plan, config, model: Qwen3Config | None = None) -> None:
        """Before any rank starts (exit 2): a vocab that Megatron cannot split evenly over TP."""
        if model is not None and model.vocab_size % config.tp:
            raise BadInput(f"--trainer megatron: vocab_size={model.vocab_size} is not a multiple of "
                           f"TP_SIZE={config.tp} (Megatron splits the embedding evenly over TP); "
                           "pad the vocab or choose another TP size")

    def __init__(self, rank: int, world: int, spec: TrainerSpec):
        self.rank, self.world, self.spec = rank, world, spec
        config = checkpoint.load_config(spec.model_root)
        self.trainer = MegatronTrainer(config, checkpoint.load_state(spec.model_root), spec.plan,
                                       spec.config)

    def readback(self, step: int, **extra: Any):
        return super().readback(step, megatron_core=parallel.megatron_core_version(), **extra)
