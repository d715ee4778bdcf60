"""`judge(run) -> Verdict`: the one place that says whether a run directory's evidence passes.

`rlk run`, `rlk validate`, `rlk matrix analyze` and the clean-room gate all call it.

- evidence_complete: the manifest names the run, plan and layout; there is exactly one readback per
  rank of each side (`<engine>-<side>-rank<r>.json`, as many as the layout's world sizes), each of
  this run id and of the manifest's source commit, with every step of the run, and in every step
  every module executed the requested implementation on that rank (an R route with launches of
  each of its kernel families, a P route with calls); the train data of this run hold every step
  and the workload's numel. Anything missing, extra, stale or malformed is a problem naming the file.
- bitwise: no compared log-prob differs in its bits.
- passed = evidence_complete and no route fell back and no log-prob is non-finite and
  (bitwise or not bitwise_required).
- exit code: 0 passed; 3 evidence incomplete; otherwise 1 (a mismatch, a non-finite value or a
  fallback is a parity-class failure wherever it is judged).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rl_engine import errors
from rl_engine.artifacts import files
from rl_engine.evidence import layout, records
from rl_engine.evidence.compare import compare
from rl_engine.runtime.plan import MODULES, SIDES, Plan

_TRACEBACK = "Traceback (most recent call last)"

# The backend families an R route of each module launches in every step on every rank; the
# rollout's logp route also computes the sampling logits with det_gemm.
R_FAMILIES: dict[str, tuple[str, ...]] = {
    "attention": ("det_gemm", "rmsnorm", "rope", "attention"),
    "ffn": ("det_gemm", "rmsnorm", "swiglu"),
    "logp": ("rmsnorm", "linear_logp"),
}


def r_families(module: str, side: str) -> tuple[str, ...]:
    return R_FAMILIES[module] + (("det_gemm",) if (module, side) == ("logp", "rollout") else ())


@dataclass(kw_only=True, slots=True)
class Expect:
    """What the caller knows the run must be; unset fields come from the manifest."""
    run_id: str | None = None
    plan: Plan | None = None
    numel: int | None = None
    # The run has ended (exit-code, run.log and the verdict file must exist and agree).
    finished: bool = False
    # The run is a matrix attempt: its matrix-case.env must exist and agree.
    matrix_attempt: bool = False


@dataclass(kw_only=True, slots=True)
class Verdict:
    run_id: str | None
    plan: dict[str, str]
    cell: str | None
    evidence_complete: bool
    bitwise: bool
    bitwise_required: bool
    passed: bool
    exit_code: int
    numel: int
    expected_numel: int | None
    mismatch_count: int
    nonfinite_count: int
    max_abs_diff: float
    first_mismatch: dict[str, Any] | None
    per_step: list[dict[str, Any]]
    fallbacks: list[dict[str, Any]]
    problems: list[str]
    sides: dict[str, Any]
    source_commit: str | None
    source_dirty: bool | None
    worker_commits: list[str]
    run_exit_code: int | None = None
    case: dict[str, str] = field(default_factory=dict)
    # One (step, sample, position, rollout, trainer, abs_diff) per compared log-prob; not in JSON.
    tokens: list[tuple] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tokens"}
        return {"kind": "rlk.verdict", **body}

    def write(self, path: Path) -> Path:
        return files.write_json(path, self.as_dict())


def _backend_tag(device: str) -> str:
    return "sm90" if str(device).startswith("cuda") else "cpu"


def _module_problems(where: str, m: dict[str, Any] | None, want: str, device: str,
                     fallbacks: list[dict], fallback_key: dict) -> list[str]:
    """fallback_key names the side, module and rank."""
    """What is wrong with one module's record of one step on one rank."""
    if not isinstance(m, dict):
        return [f"{where}: no record of this module"]
    want_impl = "rlkernel" if want == "R" else "production"
    if m.get("fallback"):
        if fallback_key not in fallbacks:
            fallbacks.append({**fallback_key, "reason": m.get("fallback_reason")})
        return []
    if m.get("actual") != want or m.get("implementation") != want_impl:
        return [f"{where}: requested {want} ({want_impl}), ran {m.get('actual')} "
                f"({m.get('implementation')})"]
    counts = {str(k): int(v) for k, v in (m.get("call_counts") or {}).items()}
    out = []
    foreign = sorted(b for b, n in counts.items() if n and not b.startswith(f"{want_impl}."))
    if foreign:
        out.append(f"{where}: the {want_impl} route launched {', '.join(foreign)}")
    if want == "R":
        tag = _backend_tag(device)
        families = r_families(fallback_key["module"], fallback_key["side"])
        missing = [f for f in families if not counts.get(f"rlkernel.{f}.{tag}.v1")]
        if missing:
            out.append(f"{where}: no launches of {', '.join(missing)}")
    elif not sum(counts.values()):
        out.append(f"{where}: the production route recorded no calls")
    return out


def _check_record(name: str, rec: dict, *, side: str, engine: str, rank: int, world: int,
                  run_id: str | None, commit: str | None, plan: Plan, steps: int,
                  fallbacks: list[dict]) -> list[str]:
    out = []
    if rec.get("run_id") != run_id:
        out.append(f"readback {name} is of run {rec.get('run_id')!r}, not {run_id!r}")
    if rec.get("source_commit") != commit:
        out.append(f"readback {name} is of source commit {rec.get('source_commit')!r}, the manifest's "
                   f"is {commit!r}")
    for key, want in (("engine", engine), ("side", side), ("rank", rank), ("world_size", world)):
        if rec.get(key) != want:
            out.append(f"readback {name} says {key}={rec.get(key)!r}, expected {want!r}")
    if rec.get("plan") != plan.as_dict():
        out.append(f"readback {name} ran plan {rec.get('plan')}, not {plan.as_dict()}")
    if all(plan.impl(m, side) == "P" for m in MODULES):
        ours = sorted(str(k) for what in ("kernel_totals", "collective_calls")
                      for k, n in (rec.get(what) or {}).items() if str(k).startswith("rlkernel.") and n)
        if ours:
            out.append(f"readback {name}: every module of the {side} side is P, yet it launched "
                       f"rl_engine kernels {ours}")
    by_step = {s.get("step"): s for s in rec.get("steps", []) if isinstance(s, dict)}
    missing = [s for s in range(steps) if s not in by_step]
    extra = sorted(str(s) for s in by_step if s not in range(steps))
    if missing:
        out.append(f"readback {name} has no record of step(s) {missing} of {steps}")
    if extra:
        out.append(f"readback {name} records step(s) {extra} outside the run's {steps}")
    for step in range(steps):
        mods = {m.get("module"): m for m in (by_step.get(step) or {}).get("modules", [])
                if isinstance(m, dict)} if step in by_step else None
        if mods is None:
            continue
        for module in MODULES:
            out += _module_problems(f"readback {name} step {step} {side} {module}", mods.get(module),
                                    plan.impl(module, side), rec.get("device", "cpu"), fallbacks,
                                    {"side": side, "module": module, "rank": rank})
    return out


def _side_summary(recs: dict[str, dict], side: str, plan: Plan) -> dict[str, Any]:
    modules = {}
    for module in MODULES:
        counts: collections.Counter = collections.Counter()
        actual, impls, fell = set(), set(), 0
        for rec in recs.values():
            for m in rec.get("modules", []):
                if isinstance(m, dict) and m.get("module") == module:
                    counts.update({str(k): int(v) for k, v in (m.get("call_counts") or {}).items()})
                    actual.add(str(m.get("actual")))
                    impls.add(str(m.get("implementation")))
                    fell += bool(m.get("fallback"))
        modules[module] = {"requested": plan.impl(module, side), "actual": sorted(actual),
                           "implementation": sorted(impls), "call_counts": dict(sorted(counts.items())),
                           "calls": sum(counts.values()), "fallbacks": fell}
    return {"records": sorted(recs), "ranks": sorted(r.get("rank") for r in recs.values()
                                                     if isinstance(r.get("rank"), int)),
            "modules": modules}


def _readbacks(run: layout.RunDir, *, run_id, commit, plan: Plan, steps: int, worlds: dict[str, int],
               engines: dict[str, str], problems: list[str],
               fallbacks: list[dict]) -> tuple[dict[str, Any], list[str]]:
    """(per-side summary, the source commits the records name)."""
    found = records.read_readbacks(run, problems)
    commits = sorted({str(r.get("source_commit")) for r in found.values()})
    sides = {}
    for side in SIDES:
        mine = {}
        for rank in range(worlds[side]):
            name = layout.readback_name(engines[side], side, rank)
            rec = found.pop(name, None)
            if rec is None:
                if not any(p.startswith(f"readback {name} ") for p in problems):
                    problems.append(f"missing readback {name} (rank {rank} of {worlds[side]} on the "
                                    f"{side} side)")
                continue
            mine[name] = rec
            problems += _check_record(name, rec, side=side, engine=engines[side], rank=rank,
                                      world=worlds[side], run_id=run_id, commit=commit, plan=plan,
                                      steps=steps, fallbacks=fallbacks)
        sides[side] = _side_summary(mine, side, plan)
    for name in sorted(found):
        problems.append(f"extra readback {name}: the layout has {worlds['training']} training and "
                        f"{worlds['rollout']} rollout ranks of engines {engines['training']} / "
                        f"{engines['rollout']}")
    return sides, commits


def _train_data(run: layout.RunDir, run_id, steps: int, problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"numel": 0, "mismatch_count": 0, "nonfinite_count": 0, "max_abs_diff": 0.0,
                           "first": None, "per_step": {}, "tokens": []}
    data = records.read_train_data(run, problems)
    if not data and not any(p.startswith("train data") for p in problems):
        problems.append("no train-data files")
    for d in data:
        step = int(d["step"])
        if d.get("run_id") != run_id:
            problems.append(f"train data {d['_file']} is of run {d.get('run_id')!r}, not {run_id!r}")
            continue
        if step not in range(steps):
            problems.append(f"train data {d['_file']} is of step {step}, outside the run's {steps}")
            continue
        c = compare(d["rollout_logprobs"], d["trainer_logprobs"])
        fig = out["per_step"].setdefault(step, {"step": step, "numel": 0, "mismatch_count": 0,
                                                "nonfinite_count": 0, "max_abs_diff": 0.0})
        for target in (out, fig):
            target["numel"] += c.numel
            target["mismatch_count"] += c.mismatch_count
            target["nonfinite_count"] += c.nonfinite_count
            target["max_abs_diff"] = max(target["max_abs_diff"], c.max_abs_diff)
        ro, tr, positions, samples = (d["rollout_logprobs"], d["trainer_logprobs"], d["positions"],
                                      d["sample_ids"])
        for s, t in np.argwhere(c.differs).tolist():
            key = (step, int(positions[s, t]), int(samples[s]))
            if out["first"] is None or key < out["first"][0]:
                out["first"] = (key, float(ro[s, t]), float(tr[s, t]))
        # Python lists once, not one numpy scalar at a time: a long workload has millions of tokens.
        for sample, pos_row, ro_row, tr_row, diff_row in zip(
                samples.tolist(), positions.tolist(), ro.tolist(), tr.tolist(), c.abs_diff.tolist()):
            out["tokens"].extend((step, int(sample), int(p), r, t, a)
                                 for p, r, t, a in zip(pos_row, ro_row, tr_row, diff_row))
    for step in range(steps):
        if data and step not in out["per_step"]:
            problems.append(f"no train data of step {step}")
    return out


def _manifest(run: layout.RunDir, problems: list[str]) -> dict[str, Any]:
    name = run.manifest.name
    try:
        man = files.read_json(run.manifest)
        if not isinstance(man, dict):
            raise ValueError("not an object")
        return man
    except FileNotFoundError:
        problems.append(f"no {name}")
    except (OSError, ValueError) as exc:
        problems.append(f"{name} is malformed: {records.short(exc)}")
    return {}


def _finished(run: layout.RunDir, run_id, data: dict[str, Any], problems: list[str]) -> int | None:
    """The exit code `rlk run` recorded, after checking what a finished run leaves: its log, no
    traceback, and the verdict it wrote agreeing with the evidence judged now."""
    code = None
    try:
        code = int(run.exit_code.read_text().strip())
    except FileNotFoundError:
        problems.append(f"no {run.exit_code.name}: the run did not finish")
    except (OSError, ValueError):
        problems.append(f"{run.exit_code.name} is malformed")
    if code not in (None, 0, 1):
        problems.append(f"rlk run exited {code}")
    if not run.log.is_file():
        problems.append(f"no {run.log.name}")
    for path in (run.log, run.console_log):
        try:
            if _TRACEBACK in path.read_text(errors="replace"):
                problems.append(f"{path.name} holds a traceback")
        except OSError:
            pass
    try:
        written = files.read_json(run.validation)
        if written.get("run_id") != run_id:
            problems.append(f"{run.validation.name} is of run {written.get('run_id')!r}")
        for key in ("numel", "mismatch_count", "nonfinite_count"):
            if written.get(key) != data[key]:
                problems.append(f"{run.validation.name} reports {key}={written.get(key)}, the train "
                                f"data hold {data[key]}")
    except FileNotFoundError:
        problems.append(f"no {run.validation.name}: the run never judged its evidence")
    except (OSError, ValueError, AttributeError) as exc:
        problems.append(f"{run.validation.name} is malformed: {records.short(exc)}")
    return code


def _case(run: layout.RunDir, expect: Expect, problems: list[str]) -> dict[str, str]:
    case = records.read_case_env(run, problems)
    if case:
        if expect.run_id is not None and case.get("RL_KERNEL_RUN_ID") != expect.run_id:
            problems.append(f"{layout.CASE_ENV} names run {case.get('RL_KERNEL_RUN_ID')!r}, this "
                            f"attempt is run {expect.run_id!r}")
        asked = records.case_plan(case)
        if asked is None:
            problems.append(f"{layout.CASE_ENV} lacks a valid plan (RL_KERNEL_*_CASE)")
        elif expect.plan is not None and asked != expect.plan:
            problems.append(f"{layout.CASE_ENV} requests plan {asked.as_dict()}, the cell is "
                            f"{expect.plan.as_dict()}")
    return case


def judge(run: layout.RunDir | Path, *, expect: Expect | None = None,
          require_bitwise: bool = False) -> Verdict:
    run = run if isinstance(run, layout.RunDir) else layout.RunDir(run)
    expect = expect or Expect()
    problems: list[str] = []
    case = _case(run, expect, problems) if expect.matrix_attempt else {}
    man = _manifest(run, problems)
    run_id = expect.run_id or man.get("run_id")
    if man and man.get("run_id") != run_id:
        problems.append(f"{run.manifest.name} is of run {man.get('run_id')!r}, not {run_id!r}")
    plan = expect.plan
    try:
        recorded = Plan(**man["plan"]) if "plan" in man else None
    except (TypeError, ValueError):
        recorded = None
        problems.append(f"{run.manifest.name} holds no valid plan")
    if plan is None:
        plan = recorded or Plan()
    elif recorded is not None and recorded != plan:
        problems.append(f"{run.manifest.name} ran plan {recorded.as_dict()}, not {plan.as_dict()}")
    lay = man.get("layout") if isinstance(man.get("layout"), dict) else {}
    steps = int(lay.get("steps", 1))
    worlds = {"training": lay.get("actor_gpus"), "rollout": lay.get("rollout_gpus")}
    if man and not all(isinstance(w, int) and w > 0 for w in worlds.values()):
        problems.append(f"{run.manifest.name} has no layout world sizes (actor_gpus, rollout_gpus)")
    worlds = {s: w if isinstance(w, int) and w > 0 else 0 for s, w in worlds.items()}
    engines = {"training": str(lay.get("trainer", "builtin")),
               "rollout": str(lay.get("rollout_engine", "builtin"))}
    expected_numel = expect.numel
    if expected_numel is None and str(case.get("EXPECTED_NUMEL", "")).isdigit():
        expected_numel = int(case["EXPECTED_NUMEL"])
    if expected_numel is None and lay.get("numel_per_step"):
        expected_numel = int(lay["numel_per_step"]) * steps
    fallbacks: list[dict] = []
    commit = man.get("source_commit")
    sides, worker_commits = _readbacks(run, run_id=run_id, commit=commit, plan=plan, steps=steps, worlds=worlds,
                       engines=engines, problems=problems, fallbacks=fallbacks)
    data = _train_data(run, run_id, steps, problems)
    if expected_numel is None:
        problems.append("the workload's numel is unknown (no layout in the manifest)")
    elif data["numel"] != expected_numel:
        problems.append(f"compared {data['numel']} log-probs, the workload expects {expected_numel}")
    run_exit = _finished(run, run_id, data, problems) if expect.finished else None
    required = require_bitwise or plan.cell == "control"
    complete = not problems
    bitwise = complete and data["mismatch_count"] == 0
    passed = complete and not fallbacks and data["nonfinite_count"] == 0 and (bitwise or not required)
    code = errors.OK if passed else (errors.INFRASTRUCTURE if not complete else errors.PARITY_FAILURE)
    if run_exit is not None and run_exit != code and complete:
        problems.append(f"rlk run exited {run_exit}, its evidence says {code}")
        complete = bitwise = passed = False
        code = errors.INFRASTRUCTURE
    first = None
    if data["first"]:
        (step, pos, sample), ro_v, tr_v = data["first"]
        first = {"step": step, "sample": sample, "position": pos, "rollout": ro_v, "trainer": tr_v}
    return Verdict(
        run_id=run_id, plan=plan.as_dict(), cell=plan.cell, evidence_complete=complete,
        bitwise=bitwise, bitwise_required=required, passed=passed, exit_code=code,
        numel=data["numel"], expected_numel=expected_numel, mismatch_count=data["mismatch_count"],
        nonfinite_count=data["nonfinite_count"], max_abs_diff=data["max_abs_diff"],
        first_mismatch=first, per_step=[data["per_step"][k] for k in sorted(data["per_step"])],
        fallbacks=fallbacks, problems=problems, sides=sides, source_commit=commit,
        source_dirty=man.get("source_dirty"),
        worker_commits=worker_commits, run_exit_code=run_exit, case=case, tokens=data["tokens"])
