"""Gradient reduction of the Megatron-core trainer on CUDA GPUs: with every training route P the
model is wrapped in Megatron's own DistributedDataParallel, whose reduced fp32 main grads are the
plain fp32 sum, in micro-batch order, of the gradients each parameter received; AdamW then
follows the reference over three resident steps. On two GPUs (CP=2) they are that sum added over
the two ranks, a sum and not a mean, with the LM head (replicated over CP) counted once. With any
route R, rl_engine's fixed-order reduction runs instead and there is no DDP."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.engines.launch import launch
from rl_engine.runtime.plan import Plan

from engines.test_optimizer_state import TRAIN, check_adamw_over_steps, steps_of
from engines.test_trainer import CONFIG, SAMPLES, STATE

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PP = Plan(attention="P/P", ffn="P/P", logp="P/P")
# Small micro-batches, so each step accumulates several gradients per parameter.
CUDA_TRAIN = dataclasses.replace(TRAIN, device="cuda", max_tokens_per_gpu=256)


def tap_gradients(trainer) -> dict[str, torch.Tensor]:
    """fp32 sums of each parameter's gradients, taken as autograd computes them (before DDP's
    hook moves them into main_grad)."""
    taps: dict[str, torch.Tensor] = {}

    def add(name: str, grad: torch.Tensor) -> None:
        taps[name] = taps[name] + grad.float() if name in taps else grad.float().clone()

    for name, p in trainer.params.items():
        p.register_hook(lambda g, name=name: add(name, g))
    return taps


def ddp_steps(rank: int, world: int) -> dict:
    from rl_engine.adapters.megatron.rank import MegatronTrainer

    trainer = MegatronTrainer(CONFIG, STATE, PP, CUDA_TRAIN)
    taps = tap_gradients(trainer)
    equal, micro_batches = [], []

    def check(trainer, result) -> None:
        micro_batches.append(result.micro_batches)
        equal.append(sorted(n for n, g in trainer.grads.items()
                            if n in taps and torch.equal(g, taps[n])))
        taps.clear()  # the next step's gradients only

    check_adamw_over_steps(steps_of(trainer, check))  # on the GPU, where the trainer's AdamW ran
    return {"reduction": trainer.gradient_reduction(), "ddp": type(trainer.ddp).__name__,
            "names": sorted(trainer.grads), "equal": equal, "micro_batches": micro_batches}


def test_all_p_sums_gradients_through_megatron_ddp():
    (out,) = launch(ddp_steps, 1, device="cuda", timeout=600)
    assert out["reduction"] == "production.megatron.ddp"
    assert out["ddp"] == "DistributedDataParallel"
    assert min(out["micro_batches"]) > 1, out["micro_batches"]
    for step, names in enumerate(out["equal"], 1):
        assert names == out["names"], (step, sorted(set(out["names"]) - set(names)))


def r_route_reduction(rank: int, world: int) -> dict:
    from rl_engine.adapters.megatron.rank import MegatronTrainer

    trainer = MegatronTrainer(CONFIG, STATE, Plan(attention="P/P", ffn="P/P", logp="R/R"),
                              CUDA_TRAIN)
    trainer.step(SAMPLES)
    return {"reduction": trainer.gradient_reduction(), "ddp": trainer.ddp,
            "main_grad": any(hasattr(p, "main_grad") for p in trainer.params.values())}


def test_an_r_route_keeps_the_fixed_order_reduction():
    (out,) = launch(r_route_reduction, 1, device="cuda", timeout=600)
    assert out == {"reduction": "rlkernel.fixed_order", "ddp": None, "main_grad": False}


def ddp_over_cp(rank: int, world: int) -> dict:
    """One step at CP=2: DDP's grads against this rank's tapped sums added over both ranks (two
    terms: the same bits in either order), the head's from CP rank 0 alone."""
    import torch.distributed as dist

    from rl_engine.adapters.megatron.rank import MegatronTrainer

    trainer = MegatronTrainer(CONFIG, STATE, PP, dataclasses.replace(CUDA_TRAIN, cp=2))
    taps = tap_gradients(trainer)
    trainer.step(SAMPLES)
    differ = []
    for name, grad in trainer.grads.items():
        mine = taps[name]
        if name == trainer.head_name and trainer.layout.cp_rank != 0:
            mine = torch.zeros_like(mine)
        dist.all_reduce(mine)
        if not torch.equal(grad, mine):
            differ.append(name)
    return {"reduction": trainer.gradient_reduction(), "differ": differ,
            "grads": len(trainer.grads)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_ddp_over_two_cp_ranks_sums_and_counts_the_head_once():
    for out in launch(ddp_over_cp, 2, device="cuda", timeout=600):
        assert out["reduction"] == "production.megatron.ddp"
        assert out["grads"] > 0 and out["differ"] == [], out["differ"]
