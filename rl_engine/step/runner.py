"""`rlk run`: N post-training steps under one operator plan, leaving a self-contained run directory.

The trainer's ranks and the rollout engines' ranks start once and stay up for every step (resident
workers). Per step: the rollout engines generate samples and report the log-prob of each sampled
token; the trainer recomputes the log-probs of the same tokens and takes a GRPO step, its AdamW
state carried over from the step before; its rank 0 publishes the updated weights in shared
memory, and every rollout rank loads them, checking each tensor's digest, for the next step. Only
samples, log-probs and digests pass through this process, never the weights. Each worker writes its
own readback; the runner writes train data and figures.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rl_engine.artifacts import files, manifest
from rl_engine.evidence import layout, records
from rl_engine.evidence.compare import compare
from rl_engine.evidence.layout import RunDir
from rl_engine.engines import sync
from rl_engine.engines.interface import rank_class
from rl_engine.engines.launch import Group, ready_all, start
from rl_engine.engines.rollout.worker import RolloutJob, merge_samples
from rl_engine.engines.train.packing import Sample as TrainSample
from rl_engine.engines.train.rank import TrainerSpec
from rl_engine.engines.train.trainer import TrainConfig
from rl_engine.errors import BadInput, InfrastructureError
from rl_engine.models.config import Qwen3Config
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


def check_device(plan: Plan, config: StepConfig, model: Qwen3Config | None = None) -> None:
    """Before any rank starts: the plan's strict R routes can run on the device (what `rlk
    preflight --device` checks), and on CUDA each rank of the larger launch gets a GPU of its own.
    Under the Ray launcher the ranks run on the cluster's machines, not this one, so their own
    routers check (strictly, before any work) and Ray's placement finds their GPUs."""
    from rl_engine import envs
    from rl_engine.engines.launch import check_devices

    for side, engine_id in (("training", config.trainer), ("rollout", config.rollout_engine)):
        refuse = getattr(rank_class(side, engine_id), "refuse", None)
        if refuse is not None:  # what a real engine cannot run, before any rank starts
            refuse(plan, config, model)
    if envs.RLK_LAUNCHER == "ray":
        return
    try:
        check_devices(config.gpus, config.device)
    except ValueError as exc:
        placed = "colocated" if config.colocate else "on separate GPUs"
        raise BadInput(f"ACTOR_GPUS={config.actor_gpus}, ROLLOUT_GPUS={config.rollout_gpus} "
                       f"{placed}: {exc}") from None
    preflight.require(plan, config.device)


def _specs(plan: Plan, config: StepConfig, inputs: Inputs, run: RunDir, run_id: str, trace: bool,
           sync_dir) -> tuple[TrainerSpec, RolloutJob]:
    trace_dir = run.trace if trace else None
    trainer = TrainerSpec(
        model_root=inputs.model_root, plan=plan, run_dir=run.root, run_id=run_id, sync_dir=sync_dir,
        trace_dir=trace_dir, config=TrainConfig(tp=config.tp, cp=config.cp, dp=config.dp,
                                                max_tokens_per_gpu=config.max_tokens_per_gpu,
                                                device=config.device))
    rollout = RolloutJob(config=inputs.config, state=None, model_root=inputs.model_root, plan=plan,
                         prompts=inputs.prompts, n_samples=config.n_samples_per_prompt,
                         max_new_tokens=config.max_response_len, seed=config.seed,
                         engines=config.engines, tp=config.rollout_gpus_per_engine,
                         run_dir=run.root, run_id=run_id, trace_dir=trace_dir,
                         device=config.device, first_gpu=config.rollout_first_gpu)
    return trainer, rollout


def _sync(trainers: Group, rollouts: Group, step: int) -> tuple[sync.Published, dict[str, float]]:
    """Trainer rank 0 publishes, every rollout rank loads and checks; (what was published, seconds)."""
    t0 = time.monotonic()
    published, *others = trainers.call("publish", step)
    drifted = [r for r, c in enumerate(others, 1) if c != published.checksum]
    if drifted:
        raise InfrastructureError(f"training ranks {drifted} hold other weights than rank 0 after "
                                  f"step {step}")
    loaded = rollouts.call("load_weights", published)
    held = {r["checksum"] for r in loaded}
    if held != {published.checksum}:
        raise InfrastructureError(f"weight sync failed after step {step}: rollout ranks hold "
                                  f"{sorted(held)}, the trainer published {published.checksum}")
    if published.path is not None:
        Path(published.path).unlink(missing_ok=True)
    rollout_digest = max(r["seconds"]["digest"] for r in loaded)
    return published, {"sync": round(time.monotonic() - t0, 3),
                       "digests": round(published.seconds["digest"] + rollout_digest, 3)}


def rollout_world(cls: type, config: StepConfig) -> int:
    """Processes the launcher starts for the rollout side: one per rank, or one per engine for an
    engine that starts its own TP workers (vLLM)."""
    return config.engines if getattr(cls, "one_process_per_engine", False) else config.rollout_gpus


def run_steps(*, plan: Plan, config: StepConfig, inputs: Inputs, run: RunDir, run_id: str,
              trace: bool = False, on_phase: Callable[[str], None] = lambda _: None) -> list[StepFigures]:
    check_device(plan, config, inputs.config)
    man = manifest.build(run_id=run_id, plan=plan.as_dict(), layout=config.as_dict(),
                         inputs=inputs.files())
    manifest.write(run.manifest, man)
    checkpoint_digest = sync.combined(sync.digests(inputs.state))
    sync_dir = sync.shared_folder(run_id)
    trainer_spec, rollout_job = _specs(plan, config, inputs, run, run_id, trace, sync_dir)
    figures: list[StepFigures] = []
    rollout_cls = rank_class("rollout", config.rollout_engine)
    t0 = time.monotonic()
    on_phase(f"starting {config.actor_gpus} training and {config.rollout_gpus} rollout ranks")
    try:
        # Both sides build at once (imports, model loads), each in its own processes.
        with start(rank_class("training", config.trainer), config.actor_gpus, args=(trainer_spec,), device=config.device,
                   name="training", wait=False) as trainers, \
                start(rollout_cls, rollout_world(rollout_cls, config), args=(rollout_job,), device=config.device,
                      first_gpu=config.rollout_first_gpu, name="rollout", wait=False) as rollouts:
            ready_all(trainers, rollouts)
            held = set(rollouts.call("weights_checksum"))
            if held != {checkpoint_digest}:
                raise InfrastructureError(f"rollout ranks loaded {sorted(held)}, the checkpoint is "
                                          f"{checkpoint_digest}")
            log.info("workers started in %.3f s", time.monotonic() - t0)
            for step in range(config.steps):
                figures.append(_step(step, config, inputs, trainers, rollouts, run, run_id, on_phase,
                                     started=t0 if step == 0 else None))
    finally:
        sync.remove_folder(sync_dir)
    return figures


def _step(step: int, config: StepConfig, inputs: Inputs, trainers: Group, rollouts: Group,
          run: RunDir, run_id: str, on_phase: Callable[[str], None],
          started: float | None) -> StepFigures:
    t0 = time.monotonic()
    on_phase(f"step {step}: rollout ({config.engines} engines x TP {config.rollout_gpus_per_engine})")
    samples = merge_samples(rollouts.call("generate", inputs.prompts, config.n_samples_per_prompt,
                                          config.max_response_len, config.seed + 1000 * step, step))
    t1 = time.monotonic()
    on_phase(f"step {step}: training (TP {config.tp} x CP {config.cp} x DP {config.dp})")
    batch = [TrainSample(prompt=tuple(s.prompt), response=tuple(s.tokens), rollout_logp=s.logprobs,
                         group=s.prompt_index) for s in samples]
    lead = trainers.call("train_step", batch, step)[0]
    t2 = time.monotonic()
    fig = _write_train_data(run, run_id, step, samples, lead["logps"], config.dp, config.tp * config.cp)
    on_phase(f"step {step}: weight sync")
    published, sync_seconds = _sync(trainers, rollouts, step)
    fig.seconds = {"rollout": round(t1 - t0, 3), "training": round(t2 - t1, 3), **sync_seconds}
    if started is not None:
        fig.seconds["worker_start"] = round(t0 - started, 3)
    log.info(fig.line())
    files.write_json(run.weights_file(step), {"run_id": run_id, "step": step,
                                              "checksum": published.checksum,
                                              "loss": lead["loss"],
                                              "optimizer_steps": lead["optimizer_steps"]})
    return fig


def summary(figures: list[StepFigures]) -> dict[str, Any]:
    return {"steps": [dataclasses.asdict(f) | {"line": f.line()} for f in figures],
            "numel": sum(f.numel for f in figures),
            "mismatch_count": sum(f.mismatch_count for f in figures),
            "nonfinite_count": sum(f.nonfinite_count for f in figures),
            "max_abs_diff": max((f.max_abs_diff for f in figures), default=0.0)}
