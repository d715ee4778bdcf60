"""`rlk run`: N post-training steps under one operator plan, leaving a self-contained run directory.

Per step: the rollout engines generate samples and report the log-prob of each sampled token; the
trainer recomputes the log-probs of the same tokens, takes a GRPO step and returns its updated
weights; the weights are synced to the rollout engines for the next step (verified by a checksum
on both sides). Each worker writes its own readback; the runner writes train-data and figures.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rl_engine.artifacts import files, manifest
from rl_engine.evidence import layout, records
from rl_engine.evidence.compare import compare
from rl_engine.evidence.layout import RunDir
from rl_engine.models.unshard import state_checksum
from rl_engine.engines.rollout.worker import RolloutJob, run_rollout
from rl_engine.errors import BadInput, InfrastructureError
from rl_engine.runtime import preflight
from rl_engine.runtime.plan import Plan
from rl_engine.step.config import StepConfig
from rl_engine.step.inputs import Inputs

log = logging.getLogger("rl_engine.step")


@dataclass(kw_only=True, slots=True)
class StepFigures:
    step: int
    rollout_id: str
    numel: int
    mismatch_count: int
    nonfinite_count: int
    max_abs_diff: float
    seconds: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        return (f"step {self.step}: train_current_rollout_logprob_numel={self.numel} "
                f"train_current_rollout_logprob_mismatch_count={self.mismatch_count} "
                f"train_current_rollout_logprob_max_abs_diff={self.max_abs_diff}")


@dataclass(frozen=True, slots=True)
class TrainOutcome:
    logprobs: list[torch.Tensor]
    state: dict[str, torch.Tensor]
    loss: float
    checksum: str


def _train(plan: Plan, config: StepConfig, inputs: Inputs, state, samples, run: RunDir, run_id: str,
           step: int, trace: bool) -> TrainOutcome:
    """Recomputes the rollout tokens' log-probs and takes one step on ACTOR_GPUS ranks."""
    from rl_engine.engines.launch import launch
    from rl_engine.engines.train.packing import Sample as TrainSample
    from rl_engine.engines.train.trainer import TrainConfig
    from rl_engine.step.train_worker import TrainStep, train_step_worker

    job = TrainStep(
        model_config=inputs.config, state=state, plan=plan,
        samples=[TrainSample(prompt=tuple(s.prompt), response=tuple(s.tokens),
                             rollout_logp=s.logprobs, group=s.prompt_index) for s in samples],
        config=TrainConfig(tp=config.tp, cp=config.cp, dp=config.dp,
                           max_tokens_per_gpu=config.max_tokens_per_gpu, device=config.device),
        run_dir=run.root, run_id=run_id, step=step, trace_dir=run.trace if trace else None)
    results = launch(train_step_worker, config.actor_gpus, args=(job,), device=config.device)
    sums = {r["checksum"] for r in results}
    if len(sums) != 1:
        raise InfrastructureError(f"trainer ranks disagree on the updated weights at step {step}")
    lead = results[0]
    return TrainOutcome(logprobs=lead["logps"], state=lead["state"], loss=lead["loss"],
                        checksum=lead["checksum"])


def _write_train_data(run: RunDir, run_id: str, step: int, samples,
                      trainer_logprobs: list[torch.Tensor], dp: int, ranks_per_replica: int) -> StepFigures:
    """One file per DP replica (its samples), named by the replica's first trainer rank."""
    numel = mismatches = nonfinite = 0
    max_diff = 0.0
    per_replica = -(-len(samples) // dp)
    for replica in range(dp):
        idx = list(range(replica * per_replica, min(len(samples), (replica + 1) * per_replica)))
        if not idx:
            continue
        ro = torch.stack([samples[i].logprobs.float() for i in idx])
        tr = torch.stack([trainer_logprobs[i].float() for i in idx])
        length = ro.shape[1]
        records.write_train_data(run, run_id=run_id, step=step, rank=replica * ranks_per_replica, payload={
            "sample_ids": torch.tensor(idx),
            "prompt_index": torch.tensor([samples[i].prompt_index for i in idx]),
            "tokens": torch.tensor([samples[i].tokens for i in idx]),
            "positions": torch.stack([torch.arange(len(samples[i].prompt), len(samples[i].prompt) + length)
                                      for i in idx]),
            "rollout_logprobs": ro, "trainer_logprobs": tr,
        })
        c = compare(ro, tr)
        numel, mismatches, nonfinite = numel + c.numel, mismatches + c.mismatch_count, nonfinite + c.nonfinite_count
        max_diff = max(max_diff, c.max_abs_diff)
    return StepFigures(step=step, rollout_id=layout.rollout_id(step), numel=numel,
                       mismatch_count=mismatches, nonfinite_count=nonfinite, max_abs_diff=max_diff)


def check_device(plan: Plan, config: StepConfig) -> None:
    """Before any rank starts: the plan's strict R routes can run on the device (what `rlk
    preflight --device` checks), and on CUDA each rank of the larger launch gets a GPU of its own.
    Under the Ray launcher the ranks run on the cluster's machines, not this one, so their own
    routers check (strictly, before any work) and Ray's placement finds their GPUs."""
    from rl_engine import envs
    from rl_engine.engines.launch import check_devices

    if envs.RLK_LAUNCHER == "ray":
        return
    try:
        check_devices(config.gpus, config.device)
    except ValueError as exc:
        placed = "colocated" if config.colocate else "on separate GPUs"
        raise BadInput(f"ACTOR_GPUS={config.actor_gpus}, ROLLOUT_GPUS={config.rollout_gpus} "
                       f"{placed}: {exc}") from None
    preflight.require(plan, config.device)


def run_steps(*, plan: Plan, config: StepConfig, inputs: Inputs, run: RunDir, run_id: str,
              trace: bool = False, on_phase: Callable[[str], None] = lambda _: None) -> list[StepFigures]:
    import time

    check_device(plan, config)
    man = manifest.build(run_id=run_id, plan=plan.as_dict(), layout=config.as_dict(),
                         inputs=inputs.files())
    manifest.write(run.manifest, man)
    state = inputs.state
    published = state_checksum(state)  # the checksum of the weights the engines must hold
    figures: list[StepFigures] = []
    for step in range(config.steps):
        t0 = time.monotonic()
        on_phase(f"step {step}: rollout ({config.engines} engines x TP {config.rollout_gpus_per_engine})")
        job = RolloutJob(config=inputs.config, state=state, plan=plan, prompts=inputs.prompts,
                         n_samples=config.n_samples_per_prompt, max_new_tokens=config.max_response_len,
                         seed=config.seed + 1000 * step, engines=config.engines,
                         tp=config.rollout_gpus_per_engine, run_dir=run.root, run_id=run_id,
                         trace_dir=run.trace if trace else None, device=config.device,
                         first_gpu=config.rollout_first_gpu, step=step)
        samples, results = run_rollout(job)
        synced = {r["weights_checksum"] for r in results}
        if synced != {published}:
            raise InfrastructureError(f"weight sync failed at step {step}: rollout engines hold "
                                      f"{sorted(synced)}, the trainer published {published}")
        t1 = time.monotonic()
        on_phase(f"step {step}: training (TP {config.tp} x CP {config.cp} x DP {config.dp})")
        result = _train(plan, config, inputs, state, samples, run, run_id, step, trace)
        t2 = time.monotonic()
        fig = _write_train_data(run, run_id, step, samples, result.logprobs, config.dp,
                                config.tp * config.cp)
        fig.seconds = {"rollout": round(t1 - t0, 3), "training": round(t2 - t1, 3)}
        log.info(fig.line())
        figures.append(fig)
        state, published = result.state, state_checksum(result.state)
        if published != result.checksum:
            raise InfrastructureError(f"the weights received from the trainer at step {step} do not "
                                      "match the checksum the trainer computed")
        files.write_json(run.weights_file(step),
                         {"run_id": run_id, "step": step, "checksum": result.checksum,
                          "loss": result.loss})
    return figures


def summary(figures: list[StepFigures]) -> dict[str, Any]:
    return {"steps": [dataclasses.asdict(f) | {"line": f.line()} for f in figures],
            "numel": sum(f.numel for f in figures),
            "mismatch_count": sum(f.mismatch_count for f in figures),
            "nonfinite_count": sum(f.nonfinite_count for f in figures),
            "max_abs_diff": max((f.max_abs_diff for f in figures), default=0.0)}
