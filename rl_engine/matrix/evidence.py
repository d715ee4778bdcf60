"""Reading one cell attempt's evidence: its case file, readbacks and train-data.

Every reader returns what it could read and appends a named problem for what it could not, so a
missing, partial or malformed file fails its attempt with a reason and never the analysis.
"""

from __future__ import annotations

import collections
import json
import shlex
from pathlib import Path
from typing import Any

from rl_engine.runtime.plan import MODULES, SIDES, Plan

CASE_ENV = "matrix-case.env"
CONSOLE_LOG = "console.log"

# The backend families (rl_engine/ops/counters.py FAMILY) an R route of each module launches.
R_FAMILIES: dict[str, tuple[str, ...]] = {
    "attention": ("det_gemm", "rmsnorm", "rope", "attention"),
    "ffn": ("det_gemm", "rmsnorm", "swiglu"),
    "logp": ("rmsnorm", "linear_logp"),
}


def short(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:160]}"


def write_case_env(path: Path, values: dict[str, Any]) -> None:
    from rl_engine.artifacts import files

    files.write_text(path, "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in values.items()))


def read_case_env(path: Path, problems: list[str]) -> dict[str, str]:
    """KEY=value lines (shell-quoted values), as write_case_env writes them."""
    try:
        text = path.read_text()
    except OSError:
        problems.append(f"no {CASE_ENV} (the matrix runner writes it before the run starts)")
        return {}
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        key, sep, raw = line.partition("=")
        try:
            value = shlex.split(raw)
        except ValueError:
            value = None
        if not sep or not key.isidentifier() or value is None or len(value) > 1:
            problems.append(f"{CASE_ENV} line {n} is malformed: {line[:80]!r}")
            continue
        out[key] = value[0] if value else ""
    return out


def case_plan(case: dict[str, str]) -> Plan | None:
    try:
        return Plan(attention=case["RL_KERNEL_ATTENTION_CASE"], ffn=case["RL_KERNEL_FFN_CASE"],
                    logp=case["RL_KERNEL_LOGP_CASE"], mode=case.get("RLK_MODE", "strict"))
    except (KeyError, ValueError):
        return None


def read_readbacks(folder: Path, problems: list[str]) -> list[dict[str, Any]]:
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            body = json.loads(path.read_text())
            if not isinstance(body, dict) or not isinstance(body.get("modules", []), list):
                raise ValueError("not a readback record")
        except (OSError, ValueError) as exc:
            problems.append(f"readback {path.name} is malformed: {short(exc)}")
            continue
        records.append({**body, "_file": path.name})
    return records


def _backend_tag(device: str) -> str:
    return "sm90" if str(device).startswith("cuda") else "cpu"


def check_sides(records: list[dict], plan: Plan, problems: list[str]) -> dict[str, Any]:
    """What each side executed per module, against what the plan asked of it."""
    sides: dict[str, Any] = {}
    for side in SIDES:
        mine = [r for r in records if r.get("side") == side]
        if not mine:
            problems.append(f"no {side} readback of this run")
        modules = {}
        for module in MODULES:
            counts: collections.Counter = collections.Counter()
            actual, impls, fallbacks = set(), set(), 0
            for r in mine:
                for m in r.get("modules", []):
                    if isinstance(m, dict) and m.get("module") == module:
                        counts.update({str(k): int(v) for k, v in (m.get("call_counts") or {}).items()})
                        actual.add(m.get("actual"))
                        impls.add(m.get("implementation"))
                        fallbacks += bool(m.get("fallback"))
            want = plan.impl(module, side)
            want_impl = "rlkernel" if want == "R" else "production"
            tags = {_backend_tag(r.get("device", "cpu")) for r in mine} or {"cpu"}
            expected = sorted(f"rlkernel.{f}.{t}.v1" for f in R_FAMILIES[module] for t in tags) \
                if want == "R" else ["production.*"]
            where = f"{side} {module}"
            if mine:
                if actual != {want} or impls != {want_impl}:
                    problems.append(f"{where}: requested {want} ({want_impl}), ran "
                                    f"{sorted(map(str, actual))} ({sorted(map(str, impls))})")
                if fallbacks:
                    problems.append(f"{where}: unplanned fallback in {fallbacks} record(s)")
                foreign = sorted(b for b in counts if not b.startswith(f"{want_impl}."))
                if foreign:
                    problems.append(f"{where}: {want_impl} route launched {', '.join(foreign)}")
                if want == "R":
                    missing = [b for b in expected if counts[b] == 0]
                    if missing:
                        problems.append(f"{where}: no launches of {', '.join(missing)}")
                elif sum(counts.values()) == 0:
                    problems.append(f"{where}: the production route recorded no calls")
            modules[module] = {"requested": want, "actual": sorted(map(str, actual)),
                               "implementation": sorted(map(str, impls)),
                               "expected_implementation": want_impl, "expected_backends": expected,
                               "call_counts": dict(sorted(counts.items())),
                               "calls": sum(counts.values()), "fallbacks": fallbacks}
        sides[side] = {"records": [r["_file"] for r in mine],
                       "pids": sorted(str(r.get("pid")) for r in mine), "modules": modules}
    return sides


def read_train_data(folder: Path, run_id: str, problems: list[str]) -> dict[str, Any]:
    """Log-prob comparison over every train-data file, and one token row per compared log-prob."""
    import torch

    out: dict[str, Any] = {"numel": 0, "mismatch_count": 0, "max_abs_diff": 0.0, "first": None,
                           "tokens": []}
    paths = sorted(folder.glob("*.pt"))
    if not paths:
        problems.append("no train-data files")
    for path in paths:
        try:
            d = torch.load(path, weights_only=True)
            ro, tr = d["rollout_logprobs"].float(), d["trainer_logprobs"].float()
            sample_ids, positions, step = d["sample_ids"], d["positions"], int(d.get("step", 0))
            if ro.dim() != 2 or ro.shape != tr.shape or positions.shape != ro.shape \
                    or sample_ids.shape != ro.shape[:1]:
                raise ValueError(f"shapes rollout {tuple(ro.shape)}, trainer {tuple(tr.shape)}, "
                                 f"positions {tuple(positions.shape)}, samples {tuple(sample_ids.shape)}")
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a named problem
            problems.append(f"train data {path.name} is malformed: {short(exc)}")
            continue
        if d.get("run_id") != run_id:
            problems.append(f"train data {path.name} is of run {d.get('run_id')!r}, not {run_id!r}")
        diff = (ro - tr).abs()
        bad = ~torch.eq(ro, tr)
        out["numel"] += ro.numel()
        out["mismatch_count"] += int(bad.sum())
        if diff.numel():
            out["max_abs_diff"] = max(out["max_abs_diff"], float(diff.max()))
        for s, t in bad.nonzero().tolist():
            key = (step, int(positions[s, t]), int(sample_ids[s]))
            if out["first"] is None or key < out["first"][0]:
                out["first"] = (key, float(ro[s, t]), float(tr[s, t]))
        for s in range(ro.shape[0]):
            for t in range(ro.shape[1]):
                out["tokens"].append((step, int(sample_ids[s]), int(positions[s, t]),
                                      float(ro[s, t]), float(tr[s, t]), float(diff[s, t])))
    if out["first"] is not None:
        (step, pos, sample), ro_v, tr_v = out["first"]
        out["first"] = {"step": step, "sample": sample, "position": pos, "rollout": ro_v,
                        "trainer": tr_v}
    return out
