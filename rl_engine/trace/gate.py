"""The trace gate: did the kernels a plan requires really launch, and nothing it forbids?

Launches are counted by family (rl_engine/trace/families.py) from torch.profiler Chrome traces
(CUDA: kernel events; CPU: `rl_engine::<op>` op events) or Nsight Systems SQLite exports (CUDA
kernels). Every R route of the plan, on the sides asked for, must launch its families; a module
that is P on every side asked for must launch none of the families only it would launch; an all-R
plan on more than one rank must use the fixed-order collectives, and on CUDA no NCCL payload.
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

SCHEMA_VERSION = 1
_SQLITE_MAGIC = b"SQLite format 3\x00"


@dataclass(slots=True)
class Counts:
    families: collections.Counter = field(default_factory=collections.Counter)
    reference: collections.Counter = field(default_factory=collections.Counter)
    events: int = 0

    def add(self, other: Counts) -> None:
        self.families.update(other.families)
        self.reference.update(other.reference)
        self.events += other.events


def _count_name(counts: Counts, name: str, device: str) -> None:
    family = fam.cuda_family(name) if device == "cuda" else fam.cpu_family(name)
    if family:
        counts.families[family] += 1
    elif fam.is_reference_collective(name, device):
        counts.reference[name] += 1


def count_chrome(path: Path, device: str) -> Counts:
    """Counts kernel events (cuda) or CPU op events (cpu) of a Chrome trace (.json or .json.gz)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt") as fh:
            body = json.load(fh)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.BadInput(f"trace {path} is not a readable Chrome trace: {exc}") from None
    events = body.get("traceEvents") if isinstance(body, dict) else body
    if not isinstance(events, list):
        raise errors.BadInput(f"trace {path} has no traceEvents list")
    wanted = {"kernel"} if device == "cuda" else {"cpu_op", "user_annotation"}
    counts = Counts()
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") not in wanted:
            continue
        counts.events += 1
        _count_name(counts, str(e.get("name", "")), device)
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


def count(paths: list[Path], device: str) -> Counts:
    total = Counts()
    for path in trace_files(paths):
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
    if counts.events == 0:
        problems.insert(0, "the trace holds no kernel or op events")
    return {
        "schema_version": SCHEMA_VERSION, "plan_name": plan_name, "cell": cell,
        "plan": plan.as_dict(), "device": device, "world_size": world_size, "tp": tp, "sides": list(sides),
        "events": counts.events, "counts": {f: counts.families[f] for f in
                                            (*fam.FAMILIES, *fam.CPU_ONLY_FAMILIES,
                                             *fam.CUDA_ONLY_FAMILIES)},
        "reference_collective_calls": reference_calls,
        "reference_collectives": dict(sorted(counts.reference.items())),
        "checks": checks, "problems": problems,
        "evidence_complete": counts.events > 0, "passed": counts.events > 0 and not problems,
    }


def exit_code(report: dict[str, Any]) -> int:
    if report["passed"]:
        return errors.OK
    return errors.PARITY_FAILURE if report["evidence_complete"] else errors.INFRASTRUCTURE
