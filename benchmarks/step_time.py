"""Step time of the R/R control over the P/P baseline: what determinism costs for one whole
post-training step (rollout, then training), not for one kernel. The model is generated from a
fixed seed (`tiny` by default, `small` = hidden 1024, 8 layers); CPU or CUDA ranks.

Each run is one `rlk run` step done in this process through rl_engine.step (its own run directory
in a temporary folder; rollout engines and trainer ranks are fresh local processes, as in `rlk
run`). R/R and P/P runs alternate, so a change of machine load falls on both; a ratio is
median(R/R) / median(P/P), for the step and for its rollout and training phases as the step runner
times them. The wall time of a run also counts writing its evidence.

    python benchmarks/step_time.py [--workload default|ci] [--repeats 3] [--model tiny|small]
        [--device cpu|cuda] [--tp N --cp N --actor-gpus N --rollout-gpus N
         --rollout-gpus-per-engine N]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rl_engine.artifacts import files, ids, provenance
from rl_engine.evidence import layout as run_dirs
from rl_engine.models.generate import init_model
from rl_engine.runtime.plan import Plan
from rl_engine.step import inputs as step_inputs
from rl_engine.step.config import StepConfig
from rl_engine.step.runner import run_steps

SCHEMA_VERSION = 1
RESULT = Path(__file__).resolve().parent / "results" / "step_time.json"
PLANS = {"R/R": Plan(), "P/P": Plan(attention="P/P", ffn="P/P", logp="P/P")}
PHASES = ("rollout", "training", "step", "wall")
LAYOUT = ("tp", "cp", "actor_gpus", "rollout_gpus", "rollout_gpus_per_engine")


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "load_average_at_start": list(os.getloadavg())}


def one_run(case: str, config: StepConfig, inputs, scratch: Path) -> dict:
    run_id = f"bench-{ids.new_attempt_id()}"
    run = run_dirs.create(scratch / run_id)
    start = time.perf_counter()
    (fig,) = run_steps(plan=PLANS[case], config=config, inputs=inputs, run=run, run_id=run_id)
    wall = time.perf_counter() - start
    return {"case": case, "rollout": fig.seconds["rollout"], "training": fig.seconds["training"],
            "step": round(fig.seconds["rollout"] + fig.seconds["training"], 3),
            "wall": round(wall, 3), "numel": fig.numel, "mismatch_count": fig.mismatch_count,
            "max_abs_diff": fig.max_abs_diff, "load_average_after": list(os.getloadavg())}


def medians(runs: list[dict], case: str) -> dict:
    return {p: statistics.median(r[p] for r in runs if r["case"] == case) for p in PHASES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="default", help="default (the runbook's: 4 trainer + "
                        "4 rollout ranks, 2 x 128 new tokens) or ci (2 + 2 ranks, 2 x 32 tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each plan")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--model", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    for name in LAYOUT:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    info = machine()
    config = StepConfig.resolve(args.workload, steps=1, device=args.device,
                                **{name: getattr(args, name) for name in LAYOUT})
    print(f"torch {info['torch']}, {info['cpu_count']} CPUs, load {info['load_average_at_start'][0]:.1f}; "
          f"workload {args.workload}: TP {config.tp} x CP {config.cp} x DP {config.dp} trainer, "
          f"{config.engines} rollout engine(s) of TP {config.rollout_gpus_per_engine}, "
          f"{config.numel_per_step} tokens")
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlk-step-time-") as tmp:
        scratch = Path(tmp)
        model = init_model(args.model, scratch / "models" / args.model, seed=0)
        inputs = step_inputs.load(model, None, count=config.rollout_batch_size)
        for i in range(args.repeats):
            for case in PLANS:
                r = one_run(case, config, inputs, scratch)
                runs.append(r)
                print(f"{i + 1}/{args.repeats} {case}: rollout {r['rollout']:7.2f} s  training "
                      f"{r['training']:7.2f} s  step {r['step']:7.2f} s  wall {r['wall']:7.2f} s  "
                      f"mismatches {r['mismatch_count']}/{r['numel']}", flush=True)
    med = {case: medians(runs, case) for case in PLANS}
    ratio = {p: med["R/R"][p] / med["P/P"][p] for p in PHASES}
    print(f"R/R over P/P (medians of {args.repeats}): step {ratio['step']:.2f}  rollout "
          f"{ratio['rollout']:.2f}  training {ratio['training']:.2f}  wall {ratio['wall']:.2f}")
    info["load_average_at_end"] = list(os.getloadavg())
    src = provenance.source()
    files.write_json(args.out, {
        "schema_version": SCHEMA_VERSION, "benchmark": "step_time", "commit": src["commit"],
        "dirty": src["dirty"], "machine": info, "model": args.model, "device": args.device,
        "workload": args.workload,
        "layout": config.as_dict(), "repeats": args.repeats,
        "plans": {case: plan.as_dict() for case, plan in PLANS.items()},
        "median_seconds": med, "ratio_r_over_p": ratio, "runs": runs})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
