"""What a multi-GPU evidence folder (benchmarks/h200_multi.sh) shows, judged against the targets
of its layout, in one JSON file with the commit and dirty flag of the checkout.

    python benchmarks/multi_gpu_summary.py OUT_DIR --gpus 4 [--out OUT_DIR/summary.json]

Each part is read from the file its step wrote; a step that wrote nothing is `missing`, and a file
written by another commit than this checkout's is `stale`: neither is ever a pass. Exit 0 when
every part passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rl_engine.artifacts import files, provenance

IPC_FAMILIES = ("ipc_all_gather", "ipc_all_reduce", "ipc_reduce_scatter")
# What each layout's script runs: run directories (each with a trace check), attention gates.
EXPECTED = {
    4: {"runs": ["rr-small", "rr-medium", "megatron-rr-small"], "ddp_runs": ["megatron-pp-small"],
        "gates": [(2, 2), (1, 4)], "matrix": True, "step_time": True},
    8: {"runs": ["rr-medium-dp2"], "ddp_runs": [], "gates": [(1, 8), (2, 4), (2, 2)],
        "matrix": False, "step_time": False},
}
DDP = "production.megatron.ddp"


def _load(path: Path) -> dict[str, Any] | None:
    """The JSON file, or None where its step wrote none (or half of one)."""
    try:
        return files.read_json(path)
    except (OSError, ValueError):
        return None


def _stale(payload: dict[str, Any] | None, commit: str | None) -> bool:
    """Whether a result names another commit than this checkout's (one naming none is judged by
    its run's manifest instead)."""
    named = (payload or {}).get("commit") or (payload or {}).get("source_commit")
    return commit is not None and named is not None and named != commit


def run_part(out: Path, name: str, commit: str | None = None) -> dict[str, Any]:
    """A strict R/R run: bitwise, complete, no fallback; its trace check passing with the three IPC
    collectives launched (under TP and CP) and no NCCL payload."""
    verdict = _load(out / name / "bitwise-validation.json")
    gate = _load(out / f"{name}-trace-gate.json")
    if verdict is None or gate is None:
        return {"passed": False, "missing": [n for n, d in (("verdict", verdict), ("trace", gate))
                                             if d is None]}
    if _stale(_load(out / name / "manifest.json"), commit) or _stale(verdict, commit):
        return {"passed": False, "stale": True}
    counts = gate.get("counts", {})
    ipc = {f: counts.get(f, 0) for f in IPC_FAMILIES}
    passed = (verdict.get("passed") is True and verdict.get("mismatch_count") == 0
              and verdict.get("max_abs_diff") == 0.0 and not verdict.get("fallbacks")
              and gate.get("passed") is True and all(ipc.values()))
    return {"passed": passed, "numel": verdict.get("numel"),
            "mismatch_count": verdict.get("mismatch_count"),
            "max_abs_diff": verdict.get("max_abs_diff"), "fallbacks": verdict.get("fallbacks"),
            "trace_check_passed": gate.get("passed"), "ipc_launches": ipc,
            "trace_problems": gate.get("problems", [])}


def ddp_part(out: Path, name: str, commit: str | None = None) -> dict[str, Any]:
    """A Megatron run with every route P: it completed, its bits differ, and every training
    readback says Megatron's DDP summed the gradients."""
    run = out / name
    readbacks = [_load(f) for f in sorted((run / "readbacks").glob("megatron-training-rank*.json"))]
    exit_code = (run / "exit-code").read_text().strip() if (run / "exit-code").is_file() else None
    if not readbacks or exit_code is None:
        return {"passed": False, "missing": ["readbacks or exit-code"]}
    if _stale(_load(run / "manifest.json"), commit):
        return {"passed": False, "stale": True}
    reductions = sorted({(r or {}).get("gradient_reduction") for r in readbacks}, key=str)
    return {"passed": exit_code == "0" and reductions == [DDP], "ranks": len(readbacks),
            "gradient_reduction": reductions, "exit_code": exit_code}


def gate_part(out: Path, gpus: int, tp: int, cp: int, commit: str | None = None) -> dict[str, Any]:
    """Both transports of one topology: Out, LSE, dQ, dK, dV equal to one rank's, and equal
    across replicas; every file of the topology must pass."""
    files = sorted((out / "attention-gate").glob(f"attention-gate*-w{gpus}-tp{tp}-cp{cp}-*.json"))
    results = {}
    for f in files:
        d = _load(f) or {}
        results[f.name] = (d.get("transport"), bool(d.get("passed"))
                           and d.get("replicas_agree") is True and not _stale(d, commit))
    transports = {t for t, _ in results.values()}
    return {"passed": len(transports) >= 2 and all(ok for _, ok in results.values()),
            "files": {name: ok for name, (_, ok) in results.items()},
            "missing": [] if len(transports) >= 2 else ["a transport"]}


def ipc_part(out: Path, gpus: int, commit: str | None = None) -> dict[str, Any]:
    d = _load(out / "ipc_collectives.json")
    if d is None:
        return {"passed": False, "missing": ["ipc_collectives.json"]}
    v = d.get("verdict", {})
    return {"passed": bool(v.get("meets_64MiB") and v.get("meets_small") and v.get("bitwise"))
            and d.get("world") == gpus and not _stale(d, commit), "world": d.get("world"), **v}


def matrix_part(out: Path, commit: str | None = None) -> dict[str, Any]:
    d = _load(out / "matrix-report.json")
    if d is None:
        return {"passed": False, "missing": ["matrix-report.json"]}
    verdict, attribution = d.get("verdict", {}), d.get("attribution", {})
    commits = {(c.get("latest") or {}).get("source_commit") for c in d.get("cells", [])}
    stale = commit is not None and commits != {commit}
    return {"passed": bool(verdict.get("passed")) and bool(attribution.get("conclusive"))
            and not stale, "verdict": verdict, "stale": stale,
            "attributed_modules": attribution.get("attributed_modules")}


def step_time_part(out: Path, commit: str | None = None) -> dict[str, Any]:
    """R/R and P/P step times of one run; the R/R runs bitwise."""
    d = _load(out / "step_time.json")
    if d is None:
        return {"passed": False, "missing": ["step_time.json"]}
    medians = {engine: {case: v.get("median_seconds", {}).get(case) for case in ("R/R", "P/P")}
               for engine, v in d.get("by_rollout_engine", {}).items()}
    rr = [r for r in d.get("runs", []) if r.get("case") == "R/R"]
    bitwise = bool(rr) and all(r.get("mismatch_count") == 0 for r in rr)
    return {"passed": bool(medians) and all(all(m.values()) for m in medians.values())
            and bitwise and not _stale(d, commit), "median_seconds": medians,
            "rr_bitwise": bitwise}


def summarise(out: Path, gpus: int, commit: str | None = None) -> dict[str, Any]:
    """Every part of the layout's evidence; with `commit`, results of another commit fail."""
    want = EXPECTED[gpus]
    parts: dict[str, Any] = {name: run_part(out, name, commit) for name in want["runs"]}
    parts.update({name: ddp_part(out, name, commit) for name in want["ddp_runs"]})
    for tp, cp in want["gates"]:
        parts[f"attention-gate-tp{tp}-cp{cp}"] = gate_part(out, gpus, tp, cp, commit)
    parts["ipc-collectives"] = ipc_part(out, gpus, commit)
    if want["matrix"]:
        parts["matrix"] = matrix_part(out, commit)
    if want["step_time"]:
        parts["step-time"] = step_time_part(out, commit)
    return {"schema_version": 1, "gpus": gpus, "parts": parts,
            "passed": all(p["passed"] for p in parts.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--gpus", type=int, required=True, choices=sorted(EXPECTED))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    src = provenance.source()
    summary = {"commit": src["commit"], "dirty": src["dirty"],
               **summarise(args.folder, args.gpus, src["commit"])}
    files.write_json(args.out or args.folder / "summary.json", summary)
    for name, part in summary["parts"].items():
        print(f"{name:32} {'passed' if part['passed'] else 'FAILED'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
