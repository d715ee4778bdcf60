"""The trainer's state persists across the steps of a run: after each of three steps its fp32
master weights and AdamW moments equal a reference AdamW update, computed here from the state
before the step and the step's reduced gradients, with bias correction of steps 1, 2, 3."""

from __future__ import annotations

import torch

from rl_engine.engines.launch import launch
from rl_engine.engines.train import TrainConfig, Trainer
from rl_engine.runtime.plan import Plan

from engines.test_trainer import CONFIG, SAMPLES, STATE

STEPS = 3
# A learning rate large enough that every step moves the bf16 weights.
TRAIN = TrainConfig(max_tokens_per_gpu=4096, lr=1e-3, weight_decay=0.01)


def reference_adamw(w, m, v, g, step: int, cfg: TrainConfig):
    """Decoupled-weight-decay Adam on fp32 tensors, one elementwise operation at a time."""
    b1, b2 = cfg.betas
    m = m * b1 + g * (1.0 - b1)
    v = v * b2 + (g * g) * (1.0 - b2)
    if cfg.weight_decay:
        w = w * (1.0 - cfg.lr * cfg.weight_decay)
    bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
    w = w - ((m / bc1) / ((v / bc2).sqrt() + cfg.eps)) * cfg.lr
    return w, m, v


def snapshot(trainer: Trainer) -> dict:
    clone = lambda d: {n: t.detach().clone() for n, t in d.items()}  # noqa: E731
    return {"master": clone(trainer.master), "m": clone(trainer.exp_avg),
            "v": clone(trainer.exp_avg_sq), "params": clone(dict(trainer.params)),
            "steps": trainer.steps}


def steps_of(trainer: Trainer, on_step=None) -> list[dict]:
    """Snapshots of one trainer object kept for STEPS steps, as a resident rank keeps it;
    on_step(trainer, result) runs after each step."""
    out = [snapshot(trainer)]
    for _ in range(STEPS):
        forward_only = trainer.logprobs(SAMPLES)
        result = trainer.step(SAMPLES)
        if on_step is not None:
            on_step(trainer, result)
        out.append({**snapshot(trainer), "grads": {n: g.clone() for n, g in trainer.grads.items()},
                    "same_logps": all(torch.equal(a, b) for a, b in zip(forward_only, result.logps))})
    return out


def three_steps(rank: int, world: int, trainer_cls: type = Trainer) -> list[dict]:
    return steps_of(trainer_cls(CONFIG, STATE, Plan(), TRAIN))


def check_adamw_over_steps(snaps: list[dict]) -> None:
    """The snapshots of three_steps follow the reference AdamW, bit for bit, from zero moments."""
    assert [s["steps"] for s in snaps] == [0, 1, 2, 3]
    assert all(s["same_logps"] for s in snaps[1:]), "logprobs() gives the bits step() recomputes"
    for moment in ("m", "v"):
        assert all(not torch.count_nonzero(t) for t in snaps[0][moment].values()), "moments start at zero"
    for step in range(1, STEPS + 1):
        before, after = snaps[step - 1], snaps[step]
        assert after["grads"].keys() == after["master"].keys() == after["params"].keys()
        for name, g in after["grads"].items():
            w, m, v = reference_adamw(before["master"][name], before["m"][name], before["v"][name],
                                      g, step, TRAIN)
            assert torch.equal(after["m"][name], m), (step, name)
            assert torch.equal(after["v"][name], v), (step, name)
            assert torch.equal(after["master"][name], w), (step, name)
            assert torch.equal(after["params"][name], w.to(after["params"][name].dtype)), (step, name)
        moved = [n for n in after["params"] if not torch.equal(after["params"][n], before["params"][n])]
        assert moved, f"step {step} moved no bf16 weight"
        if step > 1:
            # A trainer rebuilt every step would restart the moments and correct the bias as at
            # step 1: that update differs from what happened.
            name = next(iter(after["grads"]))
            restarted, _, _ = reference_adamw(before["master"][name], torch.zeros_like(before["m"][name]),
                                              torch.zeros_like(before["v"][name]),
                                              after["grads"][name], 1, TRAIN)
            assert not torch.equal(after["master"][name], restarted)


def test_master_weights_and_moments_follow_adamw_over_three_steps():
    (snaps,) = launch(three_steps, 1, timeout=300)
    check_adamw_over_steps(snaps)
