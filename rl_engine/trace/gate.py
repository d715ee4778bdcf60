"""The trace check: did the kernels a plan requires really launch, and nothing it forbids?

Launches are counted by family (rl_engine/trace/families.py) from torch.profiler Chrome traces
(CUDA: kernel events; CPU: `rl_engine::<op>` and `aten::` op events) or Nsight Systems SQLite
exports (CUDA kernels). Every R route of the plan, on the sides asked for, must launch its
families; a module that is P on every side asked for must launch none of the families only it
would launch; an all-R plan on more than one rank must use the fixed-order collectives, and on
CUDA no NCCL payload.

Chrome traces also say which module launched what: the router runs every routed op inside a
`rlk.<module>` range (rl_engine/trace/ranges.py attributes events, backward ones included). Inside
the range of a module that is R on that side no production kernel family may run (cuBLAS GEMM,
cuDNN / flash SDPA, torch's norm and softmax; on the CPU their `aten::` ops), and inside the
range of a module that is P no rl_engine family; production kernels outside every range are
allowed. A trace file's side comes from its name (`training-rank<r>-<pid>.json`,
`rollout-rank<r>-<pid>.json`, as `rlk run --trace` writes them); in a file whose name does not
say, a module's production kernels are forbidden only when it is R on every side asked for. An R
module with no range in its side's traces is incomplete evidence. Nsight exports carry no
record_function ranges (torch emits them as NVTX only under emit_nvtx), so they are counted as a
whole, as before.
"""

from __future__ import annotations

import collections
import gzip
import json
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_engine import errors
from rl_engine.runtime.plan import MODULES, SIDES, Plan, cell_plan, normalize_cell
from rl_engine.trace import families as fam
from rl_engine.trace import ranges

SCHEMA_VERSION = 1
_SQLITE_MAGIC = b"SQLite format 3\x00"


@dataclass(slots=True)
class Counts:
    families: collections.Counter = field(default_factory=collections.Counter)
    reference: collections.Counter = field(default_factory=collections.Counter)
    events: int = 0
    # (module, side or None, "production" | "rl_engine", family) -> launches inside its ranges
    inside: collections.Counter = field(default_factory=collections.Counter)
    ranges: collections.Counter = field(default_factory=collections.Counter)  # (module, side)
    outside: collections.Counter = field(default_factory=collections.Counter)  # production family
    unattributed: int = 0  # CUDA kernels whose launch is not in the trace
    # side or None -> trace files of it that can show ranges (Chrome) and that cannot (Nsight)
    ranged_files: collections.Counter = field(default_factory=collections.Counter)
    whole_files: collections.Counter = field(default_factory=collections.Counter)
    left_out: list[str] = field(default_factory=list)

    def add(self, other: Counts) -> None:
        for name in ("families", "reference", "inside", "ranges", "outside", "ranged_files",
                     "whole_files"):
            getattr(self, name).update(getattr(other, name))
        self.events += other.events
        self.unattributed += other.unattributed
        self.left_out += other.left_out


def _count_name(counts: Counts, name: str, device: str) -> None:
    family = fam.rl_engine_family(name, device)
    if family:
        counts.families[family] += 1
    elif fam.is_reference_collective(name, device):
        counts.reference[name] += 1


def side_of(path: Path) -> str | None:
    """The side a trace file records, from the name `rlk run --trace` gives it, or None."""
    for side in SIDES:
        if path.name.startswith(f"{side}-"):
            return side
    return None


def _kind_family(name: str, device: str) -> tuple[str, str] | None:
    family = fam.rl_engine_family(name, device)
    if family:
        return "rl_engine", family
    family = fam.production_family(name, device)
    return ("production", family) if family else None


def _count_ranges(counts: Counts, events: list[dict], device: str, side: str | None) -> None:
    spans = ranges.Ranges(events)
    for module, n in spans.counts.items():
        counts.ranges[module, side] += n
    if device == "cuda":
        launched = ranges.launches(events)
        for e in events:
            if e.get("ph") != "X" or e.get("cat") != "kernel":
                continue
            kind_family = _kind_family(str(e.get("name", "")), device)
            if kind_family is None:
                continue
            launch = launched.get((e.get("args") or {}).get("correlation"))
            if launch is None:
                counts.unattributed += 1
                continue
            _attribute(counts, spans.module_at(*launch), side, kind_family)
        return
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    for e, kind_family in ranges.outermost(ops, lambda name: _kind_family(name, device)):
        module = spans.module_at((e.get("pid"), e.get("tid")), float(e.get("ts", 0)))
        _attribute(counts, module, side, kind_family)


def _attribute(counts: Counts, module: str | None, side: str | None,
               kind_family: tuple[str, str]) -> None:
    kind, family = kind_family
    if module is not None:
        counts.inside[module, side, kind, family] += 1
    elif kind == "production":
        counts.outside[family] += 1


def count_chrome(path: Path, device: str) -> Counts:
    """Counts kernel events (cuda) or CPU op events (cpu) of a Chrome trace (.json or .json.gz),
    in all and by the `rlk.<module>` range they ran in."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as fh:
            body = json.load(fh)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.BadInput(f"trace {path} is not a readable Chrome trace: {exc}") from None
    events = body.get("traceEvents") if isinstance(body, dict) else body
    if not isinstance(events, list):
        raise errors.BadInput(f"trace {path} has no traceEvents list")
    events = [e for e in events if isinstance(e, dict)]
    wanted = {"kernel"} if device == "cuda" else {"cpu_op", "user_annotation"}
    counts = Counts()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in wanted:
            continue
        counts.events += 1
        _count_name(counts, str(e.get("name", "")), device)
    side = side_of(Path(path))
    counts.ranged_files[side] += 1
    _count_ranges(counts, events, device, side)
    return counts


def count_nsys(path: Path) -> Counts:
    """Counts the kernels of an Nsight Systems SQLite export (CUPTI_ACTIVITY_KIND_KERNEL)."""
    query = ("SELECT COALESCE(d.value, ''), COALESCE(s.value, '') FROM CUPTI_ACTIVITY_KIND_KERNEL k "
             "LEFT JOIN StringIds d ON d.id = k.demangledName "
             "LEFT JOIN StringIds s ON s.id = k.shortName")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            rows = db.execute(query).fetchall()
    except sqlite3.Error as exc:
        raise errors.BadInput(f"trace {path} is not an Nsight Systems export with kernels: {exc}") from None
    counts = Counts()
    counts.whole_files[side_of(Path(path))] += 1
    for demangled, short in rows:
        counts.events += 1
        _count_name(counts, demangled or short, "cuda")
    return counts


def trace_files(paths: list[Path]) -> list[Path]:
    """The files named, with a folder standing for every trace file inside it."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(
                (".json", ".json.gz", ".sqlite")))
        elif p.is_file():
            out.append(p)
        else:
            raise errors.BadInput(f"trace {p} does not exist")
    if not out:
        raise errors.BadInput(f"no trace files in {', '.join(map(str, paths))}")
    return out


def count(paths: list[Path], device: str, sides: tuple[str, ...] = SIDES) -> Counts:
    """The counts of every trace file named, leaving out those whose name says a side not asked
    for (listed in left_out)."""
    total = Counts()
    for path in trace_files(paths):
        if side_of(path) not in (*sides, None):
            total.left_out.append(str(path))
            continue
        with open(path, "rb") as fh:
            is_sqlite = fh.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC
        if is_sqlite and device != "cuda":
            raise errors.BadInput(f"trace {path} is an Nsight Systems export: it holds CUDA kernels; "
                                  "use --device cuda")
        total.add(count_nsys(path) if is_sqlite else count_chrome(path, device))
    return total


def requirements(plan: Plan, device: str, world_size: int,
                 sides: tuple[str, ...] = SIDES, tp: int = 1) -> tuple[set[str], set[str], bool]:
    """(families that must launch, families that must not, whether NCCL payload is forbidden).

    On CUDA every layout of more than one rank all-gathers (TP's vocab-parallel log-probs and
    weight gathers, CP's K/V gather). Only TP all-reduces (its row-parallel sums), so the
    all-reduce is required when tp > 1; the gradient sync over CP x DP ranks is the one
    reduce-scatter, required when world_size / tp > 1. det_gemm on CUDA counts the sm90 tensor-core
    kernel only; its plain fp32 twin (det_gemm_f32) must not run under any R plan."""
    must: set[str] = set()
    for module in MODULES:
        for side in sides:
            if plan.impl(module, side) == "R":
                must.update(fam.module_families(module, side, device))
    all_r = all(plan.impl(m, s) == "R" for m in MODULES for s in sides)
    all_p = all(plan.impl(m, s) == "P" for m in MODULES for s in sides)
    if all_r and world_size > 1:
        if device == "cuda":
            needed = {"ipc_all_gather": True, "ipc_all_reduce": tp > 1,
                      "ipc_reduce_scatter": world_size // tp > 1}
            must.update(f for f in fam.COLLECTIVE_FAMILIES if needed[f])
        else:
            must.update(fam.CPU_ONLY_FAMILIES)
    if all_p:
        forbidden = set(fam.FAMILIES) | set(fam.CPU_ONLY_FAMILIES) | set(fam.CUDA_ONLY_FAMILIES)
    else:
        forbidden = {f for m in MODULES if all(plan.impl(m, s) == "P" for s in sides)
                     for s in sides for f in fam.module_families(m, s, device)} - must
        if device == "cuda":  # the Hopper route is bf16/fp16: an fp32 GEMM fell off the tensor cores
            forbidden |= set(fam.CUDA_ONLY_FAMILIES)
    return must, forbidden, all_r and device == "cuda"


def range_checks(counts: Counts, plan: Plan,
                 sides: tuple[str, ...]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """(one row per module and side of the traces, problems, what makes the evidence incomplete).

    Inside a module's ranges on a side, the implementation it is not may not run: production
    families where it is R, rl_engine families where it is P. In a file of unknown side a family
    is forbidden only when every side asked for forbids it."""
    known = [s for s in sides if counts.ranged_files[s]]
    label_sides: list[str | None] = [*known, *([None] if counts.ranged_files[None] else [])]
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for module in MODULES:
        for side in label_sides:
            impls = {plan.impl(module, s) for s in ((side,) if side else sides)}
            impl = impls.pop() if len(impls) == 1 else None
            found = {kind: {f: n for (m, sd, k, f), n in sorted(counts.inside.items())
                            if m == module and sd == side and k == kind}
                     for kind in ("production", "rl_engine")}
            forbidden_kind = {"R": "production", "P": "rl_engine"}.get(impl)
            forbidden = found[forbidden_kind] if forbidden_kind else {}
            label = side or "unknown side"
            for family, n in forbidden.items():
                problems.append(f"{module} ({label}): {n} launches of {forbidden_kind} family "
                                f"{family} inside rlk.{module}; the plan needs {impl}")
            rows.append({"module": module, "side": side or "unknown",
                         "impl": impl or "/".join(plan.impl(module, s) for s in sides),
                         "ranges": counts.ranges[module, side], "production": found["production"],
                         "rl_engine": found["rl_engine"], "forbidden": forbidden})
    incomplete: list[str] = []
    files = counts.ranged_files + counts.whole_files
    if files and None not in files:
        for side in sides:
            if not files[side]:
                incomplete.append(f"{side}: no trace file of this side (`rlk run --trace` names "
                                  f"them {side}-rank<r>-<pid>.json)")
    for side in sides:
        if not (counts.ranged_files[side] or counts.ranged_files[None]):
            continue  # only Nsight exports: they hold no ranges to look for
        for module in MODULES:
            if plan.impl(module, side) == "R" and not (counts.ranges[module, side]
                                                       or counts.ranges[module, None]):
                incomplete.append(f"{module} ({side}): no rlk.{module} range in the trace, so what "
                                  f"the module launched is unknown; the plan routes it R")
    return rows, problems, incomplete


def gate(counts: Counts, plan_name: str, *, device: str, world_size: int = 1,
         sides: tuple[str, ...] = SIDES, tp: int = 1) -> dict[str, Any]:
    if tp < 1 or world_size % tp:
        raise errors.BadInput(f"--tp {tp} must divide --world-size {world_size}")
    cell = normalize_cell(plan_name)
    plan = cell_plan(cell)
    must, forbidden, no_reference = requirements(plan, device, world_size, sides, tp)
    checks = [{"family": f, "want": ">0", "count": counts.families[f], "ok": counts.families[f] > 0}
              for f in sorted(must)]
    checks += [{"family": f, "want": "==0", "count": counts.families[f], "ok": counts.families[f] == 0}
               for f in sorted(forbidden)]
    reference_calls = sum(counts.reference.values())
    if no_reference:
        checks.append({"family": "reference_collective", "want": "==0", "count": reference_calls,
                       "ok": reference_calls == 0})
    problems = [f"{c['family']}: {c['count']} launches, the plan needs {c['want']}"
                for c in checks if not c["ok"]]
    rows, range_problems, incomplete = range_checks(counts, plan, sides)
    problems = incomplete + problems + range_problems
    if counts.events == 0:
        problems.insert(0, "the trace holds no kernel or op events")
    complete = counts.events > 0 and not incomplete
    return {
        "schema_version": SCHEMA_VERSION, "plan_name": plan_name, "cell": cell,
        "plan": plan.as_dict(), "device": device, "world_size": world_size, "tp": tp, "sides": list(sides),
        "events": counts.events, "counts": {f: counts.families[f] for f in
                                            (*fam.FAMILIES, *fam.CPU_ONLY_FAMILIES,
                                             *fam.CUDA_ONLY_FAMILIES)},
        "reference_collective_calls": reference_calls,
        "reference_collectives": dict(sorted(counts.reference.items())),
        "checks": checks, "modules": rows,
        "production_outside_ranges": {f: counts.outside[f] for f in fam.PRODUCTION_FAMILIES[device]
                                      if counts.outside[f]},
        "unattributed_kernels": counts.unattributed,
        "trace_files_left_out": counts.left_out,
        "notes": [f"{sum(counts.whole_files.values())} Nsight Systems export(s): they hold no "
                  "record_function ranges (torch writes them as NVTX only under emit_nvtx), so "
                  "their kernels are counted as a whole, not by module"] if counts.whole_files else [],
        "problems": problems,
        "evidence_complete": complete, "passed": complete and not problems,
    }


def exit_code(report: dict[str, Any]) -> int:
    if report["passed"]:
        return errors.OK
    return errors.PARITY_FAILURE if report["evidence_complete"] else errors.INFRASTRUCTURE
