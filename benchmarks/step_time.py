"""Step time of the resident RL loop, R/R control against the P/P baseline in the same run.

Each run is one `rlk run` of --steps steps done in this process through rl_engine.step (its own run
directory in a temporary folder): the trainer's and the rollout engines' ranks start once, then
serve every step. Reported: the workers' start (once per run), and for steps 2..N the rollout,
training, weight sync and digest times and the whole step, as the step runner times them (step 1
also pays first-call costs, so it is left out). R/R and P/P runs alternate, so a change of machine
load falls on both; a ratio is median(R/R) / median(P/P). The model is generated from a fixed seed
(`tiny`, `small` or `medium`); CPU or CUDA ranks.

--rollout-engine may be given more than once (`--rollout-engine vllm --rollout-engine builtin`):
each engine then runs both plans in the same run, interleaved, and the result also gives each
engine's times against the first's (vLLM with every module R against stock vLLM and against the
built-in engine, say).

    python benchmarks/step_time.py [--workload default|ci] [--steps 4] [--repeats 2]
        [--model tiny|small|medium] [--device cpu|cuda] [--trainer builtin|megatron]
        [--rollout-engine builtin|vllm ...] [--tp N --cp N --actor-gpus N
         --rollout-gpus N --rollout-gpus-per-engine N --rollout-batch-size N
         --n-samples-per-prompt N --max-response-len N]
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
from rl_engine.engines.interface import ROLLOUT_ENGINES, TRAINERS
from rl_engine.evidence import layout as run_dirs
from rl_engine.models.generate import init_model
from rl_engine.runtime.plan import Plan
from rl_engine.step import inputs as step_inputs
from rl_engine.step.config import StepConfig
from rl_engine.step.runner import run_steps

SCHEMA_VERSION = 3
RESULT = Path(__file__).resolve().parent / "results" / "step_time.json"
PLANS = {"R/R": Plan(), "P/P": Plan(attention="P/P", ffn="P/P", logp="P/P")}
PHASES = ("rollout", "training", "sync", "digests", "step")
LAYOUT = ("tp", "cp", "actor_gpus", "rollout_gpus", "rollout_gpus_per_engine", "rollout_batch_size",
          "n_samples_per_prompt", "max_response_len")


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "load_average_at_start": list(os.getloadavg())}


def one_run(case: str, config: StepConfig, inputs, scratch: Path) -> dict:
    run_id = f"bench-{ids.new_attempt_id()}"
    run = run_dirs.create(scratch / run_id)
    start = time.perf_counter()
    figures = run_steps(plan=PLANS[case], config=config, inputs=inputs, run=run, run_id=run_id)
    wall = time.perf_counter() - start
    steps = [{**{p: f.seconds[p] for p in PHASES[:-1]},
              "step": round(sum(f.seconds[p] for p in ("rollout", "training", "sync")), 3)}
             for f in figures]
    return {"case": case, "rollout_engine": config.rollout_engine,
            "worker_start": figures[0].seconds["worker_start"], "steps": steps,
            "later_steps": {p: statistics.median(s[p] for s in steps[1:]) for p in PHASES},
            "wall": round(wall, 3), "numel": sum(f.numel for f in figures),
            "mismatch_count": sum(f.mismatch_count for f in figures),
            "max_abs_diff": max(f.max_abs_diff for f in figures),
            "load_average_after": list(os.getloadavg())}


def medians(runs: list[dict], case: str, engine: str) -> dict:
    mine = [r for r in runs if r["case"] == case and r["rollout_engine"] == engine]
    out = {p: statistics.median(r["later_steps"][p] for r in mine) for p in PHASES}
    out["worker_start"] = statistics.median(r["worker_start"] for r in mine)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="default", help="default (the runbook's: 4 trainer + "
                        "4 rollout ranks, 2 x 128 new tokens) or ci (2 + 2 ranks, 2 x 32 tokens)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (at least 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each plan")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--model", default="tiny", choices=("tiny", "small", "medium"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--trainer", default=None, choices=TRAINERS,
                        help="the trainer's engine id (default: RLK_TRAINER, else builtin)")
    parser.add_argument("--rollout-engine", action="append", choices=ROLLOUT_ENGINES,
                        help="a rollout engine's id, once per engine to compare (default: "
                        "RLK_ROLLOUT_ENGINE, else builtin)")
    for name in LAYOUT:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: steps 2..N are the ones measured")
    logging.basicConfig(level=logging.WARNING)
    info = machine()
    configs = [StepConfig.resolve(args.workload, steps=args.steps, device=args.device,
                                  trainer=args.trainer, rollout_engine=engine,
                                  **{name: getattr(args, name) for name in LAYOUT})
               for engine in (args.rollout_engine or [None])]
    config, engines = configs[0], [c.rollout_engine for c in configs]
    print(f"torch {info['torch']}, {info['cpu_count']} CPUs, load {info['load_average_at_start'][0]:.1f}; "
          f"model {args.model} on {args.device}, workload {args.workload}, trainer {config.trainer}, "
          f"rollout engine(s) {', '.join(engines)}: TP {config.tp} x CP "
          f"{config.cp} x DP {config.dp} trainer, {config.engines} rollout engine(s) of TP "
          f"{config.rollout_gpus_per_engine}, {config.numel_per_step} tokens a step, {args.steps} steps")
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlk-step-time-") as tmp:
        scratch = Path(tmp)
        model = init_model(args.model, scratch / "models" / args.model, seed=0)
        inputs = step_inputs.load(model, None, count=config.rollout_batch_size)
        for i in range(args.repeats):
            for engine_config in configs:
                for case in PLANS:
                    r = one_run(case, engine_config, inputs, scratch)
                    runs.append(r)
                    m = r["later_steps"]
                    print(f"{i + 1}/{args.repeats} {r['rollout_engine']} {case}: workers start "
                          f"{r['worker_start']:6.2f} s; steps 2..{args.steps}: step {m['step']:6.2f} s "
                          f"(rollout {m['rollout']:6.2f}, training {m['training']:6.2f}, sync "
                          f"{m['sync']:5.2f}, digests {m['digests']:5.2f}); mismatches "
                          f"{r['mismatch_count']}/{r['numel']}", flush=True)
    by_engine = {}
    for engine in engines:
        med = {case: medians(runs, case, engine) for case in PLANS}
        ratio = {p: med["R/R"][p] / med["P/P"][p] if med["P/P"][p] else None for p in PHASES}
        by_engine[engine] = {"median_seconds": med, "ratio_r_over_p": ratio}
        print(f"{engine}: R/R step {med['R/R']['step']:.2f} s, P/P step {med['P/P']['step']:.2f} s: "
              f"R/R over P/P {ratio['step']:.2f} (rollout {ratio['rollout']:.2f}, training "
              f"{ratio['training']:.2f})")
    # Each later engine's rollout time per step against the first engine's, plan by plan.
    first = by_engine[engines[0]]["median_seconds"]
    against = {f"{engine} {case} over {engines[0]} {case}":
               by_engine[engine]["median_seconds"][case]["rollout"] / first[case]["rollout"]
               for engine in engines[1:] for case in PLANS if first[case]["rollout"]}
    for name, value in against.items():
        print(f"rollout per step, {name}: {value:.2f}")
    info["load_average_at_end"] = list(os.getloadavg())
    src = provenance.source()
    files.write_json(args.out, {
        "schema_version": SCHEMA_VERSION, "benchmark": "step_time", "commit": src["commit"],
        "dirty": src["dirty"], "machine": info, "model": args.model, "device": args.device,
        "workload": args.workload, "steps": args.steps,
        "trainer": config.trainer, "rollout_engines": engines,
        "layout": config.as_dict(), "repeats": args.repeats,
        "plans": {case: plan.as_dict() for case, plan in PLANS.items()},
        "by_rollout_engine": by_engine, "rollout_against_first_engine": against, "runs": runs})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
