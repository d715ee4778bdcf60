"""One training step of a TP x CP x DP Megatron-style trainer: recompute the log-probs of the
rollout tokens, GRPO loss, backward over packed micro-batches, fixed-order gradient reduction,
AdamW.

Gradients: each micro-batch's parameter gradients are added to fp32 main grads in micro-batch order;
q/k-norm gradients (replicated weights applied to this rank's heads) are summed over TP; then one
all-reduce over CP x DP, in rank order when any training route is R. AdamW runs in fp32 on master
weights, elementwise, and the bf16 parameters are their rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl_engine.engines.launch import DEVICES, rank_device
from rl_engine.engines.train import layout as layout_mod
from rl_engine.engines.train import loss
from rl_engine.engines.train.context_parallel import (ContextParallelAttention, GatherRows,
                                                      PackedAttention, RowExchange,
                                                      RowOrderedRouter)
from rl_engine.engines.train.packing import MicroBatch, Sample, pack
from rl_engine.models.config import Qwen3Config
from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.unshard import full_state, state_checksum
from rl_engine.models.tp import TPGroup
from rl_engine.ops.attention import kv_block_size
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    max_tokens_per_gpu: int = 8192
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float = 0.2
    adv_eps: float = 1e-6
    device: str = "cpu"  # cpu, or cuda: the GPU the launcher gave this rank

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}; use one of {', '.join(DEVICES)}")
        if self.max_tokens_per_gpu < 1:
            raise ValueError(f"MAX_TOKENS_PER_GPU={self.max_tokens_per_gpu} must be positive")
        if self.lr <= 0 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"lr={self.lr} must be positive and betas={self.betas} in [0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    logps: list[torch.Tensor]  # fp32 log-prob of each response token, per sample, in sample order
    loss: float
    rewards: list[float]
    micro_batches: int  # on this rank


class Trainer:
    """This rank's shard of the model, its fp32 master weights and AdamW state. Every rank of the
    layout calls step() with the same samples; DP ranks take contiguous slices of them."""

    # Parameter names the gradient rules single out; a trainer over another model names its own.
    head_name = "lm_head"
    qk_norm_names = ("q_norm", "k_norm")

    def __init__(self, model_config: Qwen3Config, state: dict[str, torch.Tensor], plan: Plan,
                 config: TrainConfig, *, reward_fn: loss.RewardFn = loss.even_token_reward):
        self.config, self.reward_fn = config, reward_fn
        self.layout = lay = layout_mod.build(config.tp, config.cp, config.dp)
        router_cls = RowOrderedRouter if config.cp > 1 else Router
        self.router = router_cls(plan, side="training", engine="builtin",
                                 device=rank_device(config.device))
        self.device = self.router.device
        self.model = Qwen3(model_config, self.router, TPGroup(lay.tp_rank, lay.tp, lay.tp_group))
        self.model.load_full(state)
        self.set_attention(model_config)
        self.start_optimizer()

    def set_attention(self, model_config: Qwen3Config) -> None:
        """The attention's softmax scale and KV block for the model's head_dim. The block is the
        rollout's, and the CP chunks are cut at its multiples."""
        self.scale = model_config.head_dim ** -0.5
        self.block = kv_block_size(model_config.head_dim)

    def start_optimizer(self) -> None:
        """fp32 master copies of the loaded parameters, zero AdamW moments, step 0: the state
        the rank keeps for the whole run."""
        self.params = dict(self.model.named_parameters())
        self.master = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.exp_avg = {n: torch.zeros_like(m) for n, m in self.master.items()}
        self.exp_avg_sq = {n: torch.zeros_like(m) for n, m in self.master.items()}
        self.grads: dict[str, torch.Tensor] = {}
        self.steps = 0

    # -- one step -----------------------------------------------------------------------------
    def step(self, samples: list[Sample]) -> StepResult:
        """Recomputes every sample's log-probs, takes one optimizer step, and returns the
        log-probs of all samples (gathered over DP) and the global batch's loss."""
        cfg = self.config
        rewards = [float(self.reward_fn(s)) for s in samples]
        adv = loss.group_advantages(rewards, [s.group_key for s in samples], cfg.adv_eps)
        tokens = sum(len(s.response) for s in samples)
        lo, batches = self._dp_share(samples)
        main = {n: torch.zeros_like(m) for n, m in self.master.items()}
        mine: list[torch.Tensor] = []
        for batch in batches:
            idx = [lo + i for i in batch]
            mine += self._micro_batch([samples[i] for i in idx], [adv[i] for i in idx], tokens)
            self._accumulate(main)
        self._reduce(main)
        self._adamw(main)
        self.grads = main
        # Log-probs leave the rank on the CPU; the reported loss is computed there from them.
        logps = self._gather_dp([t.cpu() for t in mine])
        terms = loss.token_terms(torch.cat(logps), _rollout_logps(samples),
                                 _token_advantages(samples, adv), cfg.clip)
        return StepResult(logps=logps, loss=float(loss.batch_loss(terms, tokens)), rewards=rewards,
                          micro_batches=len(batches))

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Every sample's log-probs under the current weights, gathered over DP; no step."""
        lo, batches = self._dp_share(samples)
        mine: list[torch.Tensor] = []
        for batch in batches:
            idx = [lo + i for i in batch]
            mine += self._micro_batch([samples[i] for i in idx], [0.0] * len(idx), 1, train=False)
        return self._gather_dp([t.cpu() for t in mine])

    def _dp_share(self, samples: list[Sample]) -> tuple[int, list]:
        """(index of this DP rank's first sample, its packed micro-batches)."""
        cfg, lay = self.config, self.layout
        if len(samples) < cfg.dp:
            raise ValueError(f"{len(samples)} samples cannot be split over DP={cfg.dp} ranks")
        lo = lay.dp_rank * len(samples) // cfg.dp
        hi = (lay.dp_rank + 1) * len(samples) // cfg.dp
        return lo, pack([s.length for s in samples[lo:hi]], cp=cfg.cp,
                        max_tokens=cfg.max_tokens_per_gpu, block=self.block)

    def _micro_batch(self, samples: list[Sample], adv: list[float], global_tokens: int, *,
                     train: bool = True):
        cfg, lay, model, dev = self.config, self.layout, self.model, self.device
        mb = MicroBatch([s.length for s in samples], cfg.cp, self.block)
        tokens_all = torch.cat([s.tokens() for s in samples]).to(dev)
        # Row t-1 predicts response token t. Row bookkeeping stays on the CPU; index tensors are
        # moved to the device where they index.
        pred = torch.cat([torch.arange(mb.offsets[b] + len(s.prompt) - 1, mb.offsets[b + 1] - 1)
                          for b, s in enumerate(samples)])
        rows = mb.rows(lay.cp_rank)
        if cfg.cp == 1:
            backend = PackedAttention(self.router, mb, self.scale)
            hidden = model.hidden(tokens_all, backend.positions, backend)
            h = hidden[pred.to(dev)]
        else:
            owned = [mb.rows(r) for r in range(cfg.cp)]
            ex = RowExchange(owned, torch.arange(mb.total), lay.cp_rank, lay.cp_group, device=dev)
            backend = ContextParallelAttention(self.router, mb, ex, self.scale)
            with self.router.row_ordered(ex, cfg.cp, model.embed):
                hidden = model.hidden(tokens_all[rows.to(dev)], backend.q_pos, backend)
            pred_set = set(pred.tolist())
            pred_owned = [torch.tensor([g for g in o.tolist() if g in pred_set], dtype=torch.long)
                          for o in owned]
            local = torch.tensor([i for i, g in enumerate(rows.tolist()) if g in pred_set],
                                 dtype=torch.long, device=dev)
            pred_ex = RowExchange(pred_owned, pred, lay.cp_rank, lay.cp_group, device=dev)
            h = GatherRows.apply(hidden[local], pred_ex, self.router, "logp", True)
        logp = model.selected_logp(h, tokens_all[(pred + 1).to(dev)])
        if not train:
            return list(logp.detach().split([len(s.response) for s in samples]))
        terms = loss.token_terms(logp, _rollout_logps(samples).to(dev),
                                 _token_advantages(samples, adv).to(dev), cfg.clip)
        loss.batch_loss(terms, global_tokens).backward()
        return list(logp.detach().split([len(s.response) for s in samples]))

    # -- gradients and optimizer --------------------------------------------------------------
    def gradient_reduction(self) -> str:
        """What sums the gradients over CP x DP (recorded in every readback)."""
        return "rlkernel.fixed_order" if self.router.any_r() else "production.all_reduce"

    def _not_counted_here(self) -> tuple[str, ...]:
        """Parameters whose gradient this rank leaves out of the sum: the LM head runs on rows
        gathered over CP, so its gradient is the same on every CP rank and is counted on CP rank 0
        only."""
        return () if self.layout.cp_rank == 0 else (self.head_name,)

    def _accumulate(self, main: dict[str, torch.Tensor]) -> None:
        """Adds this micro-batch's parameter gradients to the fp32 main grads."""
        skip = self._not_counted_here()
        for n, p in self.params.items():
            if p.grad is not None and n not in skip:
                main[n] += p.grad.float()
            p.grad = None

    def _reduce(self, main: dict[str, torch.Tensor]) -> None:
        self._sum_qk_norms_over_tp(main)
        self._sum_over_grad_group(main)

    def _sum_qk_norms_over_tp(self, main: dict[str, torch.Tensor]) -> None:
        """q/k-norm weights are replicated over TP but applied to each rank's own heads."""
        lay = self.layout
        if lay.tp > 1:
            for n in main:
                if n.endswith(self.qk_norm_names):
                    main[n] = self.router.collective("attention", "all_reduce", main[n],
                                                     lay.tp_group)

    def _sum_over_grad_group(self, main: dict[str, torch.Tensor]) -> None:
        lay = self.layout
        names = list(main)
        flat = torch.cat([main[n].flatten() for n in names])
        flat = self.router.sum_gradients(flat, lay.grad_group)
        for n, part in zip(names, flat.split([main[n].numel() for n in names])):
            main[n] = part.view_as(main[n])

    @torch.no_grad()
    def _adamw(self, main: dict[str, torch.Tensor]) -> None:
        """Decoupled-weight-decay Adam, one elementwise op at a time in fp32 (no fused kernels,
        so every element's bits depend only on its own values)."""
        cfg = self.config
        self.steps += 1
        b1, b2 = cfg.betas
        bc1, bc2 = 1.0 - b1 ** self.steps, 1.0 - b2 ** self.steps
        for n, p in self.params.items():
            g, m, v, w = main[n], self.exp_avg[n], self.exp_avg_sq[n], self.master[n]
            m.mul_(b1).add_(g * (1.0 - b1))
            v.mul_(b2).add_((g * g) * (1.0 - b2))
            if cfg.weight_decay:
                w.mul_(1.0 - cfg.lr * cfg.weight_decay)
            update = (m / bc1) / ((v / bc2).sqrt() + cfg.eps)
            w.sub_(update * cfg.lr)
            p.copy_(w.to(p.dtype))

    def _gather_dp(self, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.layout.dp == 1:
            return mine
        parts: list = [None] * self.layout.dp
        dist.all_gather_object(parts, mine, group=self.layout.dp_group)
        return [t for part in parts for t in part]

    # -- weights ------------------------------------------------------------------------------
    def full_state_dict(self, which: str = "weights") -> dict[str, torch.Tensor]:
        """Hugging Face-named full tensors, TP shards gathered: the bf16 weights (for the rollout's
        weight sync), the fp32 master weights, or the last step's reduced fp32 gradients."""
        source = {"weights": {n: p.detach() for n, p in self.params.items()},
                  "master": self.master, "grads": self.grads}[which]
        return full_state(self.model, source)

    def checksum(self, which: str = "weights") -> str:
        return state_checksum(self.full_state_dict(which))


def _rollout_logps(samples: list[Sample]) -> torch.Tensor:
    return torch.cat([s.rollout_logp.float() for s in samples])


def _token_advantages(samples: list[Sample], adv: list[float]) -> torch.Tensor:
    return torch.cat([torch.full((len(s.response),), a, dtype=torch.float32)
                      for s, a in zip(samples, adv)])
