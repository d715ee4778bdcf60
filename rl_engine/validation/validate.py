"""`rlk validate`: are the evidence complete, and are the log-probs bitwise equal?

Verdict fields: evidence_complete (every requested route executed on both sides, every record of
this run id, numel as expected), bitwise (mismatch_count == 0), bitwise_required (the control, or
--require-bitwise), passed = evidence_complete and (bitwise or not bitwise_required) and no
fallback. Exit codes: 0 passed, 1 parity failure, 3 evidence incomplete.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import torch

from rl_engine import errors
from rl_engine.runtime.plan import MODULES, SIDES, Plan


def _load_readbacks(folder: Path, problems: list[str]) -> list[dict[str, Any]]:
    records = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            records.append({**json.loads(path.read_text()), "_file": path.name})
        except (OSError, json.JSONDecodeError) as exc:
            problems.append(f"readback {path.name} is unreadable: {exc}")
    return records


def _load_train_data(folder: Path, problems: list[str]) -> list[dict[str, Any]]:
    out = []
    for path in sorted(Path(folder).glob("*.pt")):
        try:
            out.append({**torch.load(path, weights_only=True), "_file": path.name})
        except Exception as exc:  # noqa: BLE001 - a corrupt file is a named problem, not a crash
            problems.append(f"train data {path.name} is unreadable: {type(exc).__name__}")
    return out


def _side_summary(records: list[dict], side: str, plan: Plan, mode_problems: list[str],
                  fallbacks: list[dict]) -> dict[str, Any]:
    mine = [r for r in records if r.get("side") == side]
    modules: dict[str, Any] = {}
    for module in MODULES:
        counts: collections.Counter = collections.Counter()
        impls, actual = set(), set()
        for r in mine:
            for m in r.get("modules", []):
                if m.get("module") != module:
                    continue
                counts.update(m.get("call_counts", {}))
                impls.add(m.get("implementation"))
                actual.add(m.get("actual"))
                if m.get("fallback"):
                    fallbacks.append({"side": side, "module": module, "pid": r.get("pid"),
                                      "reason": m.get("fallback_reason")})
        want = plan.impl(module, side)
        want_impl = "rlkernel" if want == "R" else "production"
        prefix = "rlkernel." if want == "R" else "production."
        executed = sum(n for b, n in counts.items() if b.startswith(prefix))
        if mine and (impls != {want_impl} or executed == 0):
            mode_problems.append(f"{side} {module}: requested {want_impl}, executed "
                                 f"{sorted(i for i in impls if i) or 'nothing'} ({executed} calls)")
        modules[module] = {"requested": want, "actual": sorted(a for a in actual if a),
                           "implementations": sorted(i for i in impls if i),
                           "backend_ids": sorted(counts), "call_counts": dict(sorted(counts.items())),
                           "calls": sum(counts.values())}
    return {"processes": sorted(r.get("pid") for r in mine), "files": [r["_file"] for r in mine],
            "modules": modules}


def validate(readback_dir: Path, train_data_dir: Path, *, run_id: str | None = None,
             plan: Plan | None = None, expected_numel: int | None = None,
             require_bitwise: bool = False) -> dict[str, Any]:
    problems: list[str] = []
    records = _load_readbacks(readback_dir, problems)
    data = _load_train_data(train_data_dir, problems)
    if run_id is None and data:
        run_id = data[0].get("run_id")
    if plan is None:
        plan = Plan(**records[0]["plan"]) if records and "plan" in records[0] else Plan()
    for side in SIDES:
        if not any(r.get("side") == side for r in records):
            problems.append(f"no {side} readback in {readback_dir}")
    seen = collections.Counter((r.get("run_id"), r.get("source_commit")) for r in records)
    for r in records:
        if r.get("run_id") != run_id:
            problems.append(f"readback {r['_file']} is of run {r.get('run_id')!r}, not {run_id!r}")
        if r.get("plan") and r["plan"] != plan.as_dict():
            problems.append(f"readback {r['_file']} ran plan {r['plan']}, not {plan.as_dict()}")
    for d in data:
        if d.get("run_id") != run_id:
            problems.append(f"train data {d['_file']} is of run {d.get('run_id')!r}, not {run_id!r}")
    route_problems: list[str] = []
    fallbacks: list[dict] = []
    sides = {s: _side_summary(records, s, plan, route_problems, fallbacks) for s in SIDES}
    problems += route_problems

    numel = mismatches = 0
    max_diff = 0.0
    first = None
    per_step: dict[int, dict[str, Any]] = {}
    for d in sorted(data, key=lambda d: (d.get("step", 0), d["_file"])):
        ro, tr = d["rollout_logprobs"].float(), d["trainer_logprobs"].float()
        if ro.shape != tr.shape:
            problems.append(f"train data {d['_file']}: rollout {tuple(ro.shape)} vs trainer {tuple(tr.shape)}")
            continue
        diff = (ro - tr).abs()
        bad = ~torch.eq(ro, tr)
        step = int(d.get("step", 0))
        fig = per_step.setdefault(step, {"step": step, "numel": 0, "mismatch_count": 0, "max_abs_diff": 0.0})
        fig["numel"] += ro.numel()
        fig["mismatch_count"] += int(bad.sum())
        fig["max_abs_diff"] = max(fig["max_abs_diff"], float(diff.max()) if diff.numel() else 0.0)
        numel += ro.numel()
        mismatches += int(bad.sum())
        max_diff = max(max_diff, float(diff.max()) if diff.numel() else 0.0)
        if first is None and bad.any():
            s, t = (int(i) for i in bad.nonzero()[0])
            first = {"step": step, "sample": int(d["sample_ids"][s]), "position": int(d["positions"][s, t]),
                     "rollout": float(ro[s, t]), "trainer": float(tr[s, t])}
    if not data:
        problems.append(f"no train data in {train_data_dir}")
    if expected_numel is not None and numel != expected_numel:
        problems.append(f"compared {numel} log-probs, the workload expects {expected_numel}")
    evidence_complete = not problems
    bitwise = evidence_complete and mismatches == 0
    required = require_bitwise or plan.cell == "control"
    passed = evidence_complete and (bitwise or not required) and not fallbacks
    return {
        "run_id": run_id, "plan": plan.as_dict(), "cell": plan.cell,
        "evidence_complete": evidence_complete, "bitwise": bitwise, "bitwise_required": required,
        "passed": passed, "torch_equal": bitwise, "numel": numel, "expected_numel": expected_numel,
        "mismatch_count": mismatches, "max_abs_diff": max_diff, "first_mismatch": first,
        "per_step": [per_step[k] for k in sorted(per_step)], "fallback_failures": fallbacks,
        "problems": problems, "sides": sides,
        "readback_sources": [{"run_id": k[0], "source_commit": k[1], "records": n} for k, n in seen.items()],
    }


def exit_code(report: dict[str, Any]) -> int:
    if report["passed"]:
        return errors.OK
    if not report["evidence_complete"]:
        return errors.INFRASTRUCTURE
    return errors.PARITY_FAILURE
