"""What a multi-GPU evidence folder (benchmarks/h200_multi.sh) shows, judged against the targets
of its layout, in one JSON file with the commit and dirty flag of the checkout.

    python benchmarks/multi_gpu_summary.py OUT_DIR --gpus 4 [--out OUT_DIR/summary.json]

Each part is read from the file its step wrote; a step that wrote nothing is `missing`, never a
pass. Exit 0 when every part present passed and none is missing, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

IPC_FAMILIES = ("ipc_all_gather", "ipc_all_reduce", "ipc_reduce_scatter")
# What each layout's script runs: run directories (each with a trace check), attention gates.
EXPECTED = {
    4: {"runs": ["rr-small", "rr-medium", "megatron-rr-small"],
        "gates": [(2, 2), (1, 4)], "matrix": True, "step_time": True},
    8: {"runs": ["rr-medium-dp2"], "gates": [(1, 8), (2, 4), (2, 2)], "matrix": False,
        "step_time": False},
}


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_part(out: Path, name: str) -> dict[str, Any]:
    """A strict R/R run: bitwise, complete, no fallback; its trace check passing with the three IPC
    collectives launched (under TP and CP) and no NCCL payload."""
    verdict = _load(out / name / "bitwise-validation.json")
    gate = _load(out / f"{name}-trace-gate.json")
    if verdict is None or gate is None:
        return {"passed": False, "missing": [n for n, d in (("verdict", verdict), ("trace", gate))
                                             if d is None]}
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


def gate_part(out: Path, gpus: int, tp: int, cp: int) -> dict[str, Any]:
    """Both transports of one topology: Out, LSE, dQ, dK, dV equal to one rank's, and equal
    across replicas."""
    files = sorted((out / "attention-gate").glob(f"attention-gate*-w{gpus}-tp{tp}-cp{cp}-*.json"))
    results = {}
    for f in files:
        d = _load(f) or {}
        results[d.get("transport", f.name)] = bool(d.get("passed")) and d.get("replicas_agree",
                                                                               True) is True
    transports = sorted(results)
    return {"passed": len(results) >= 2 and all(results.values()), "transports": results,
            "missing": [] if len(transports) >= 2 else ["a transport"]}


def ipc_part(out: Path) -> dict[str, Any]:
    d = _load(out / "ipc_collectives.json")
    if d is None:
        return {"passed": False, "missing": ["ipc_collectives.json"]}
    v = d.get("verdict", {})
    return {"passed": bool(v.get("meets_64MiB") and v.get("meets_small") and v.get("bitwise")),
            "world": d.get("world"), **v}


def matrix_part(out: Path) -> dict[str, Any]:
    d = _load(out / "matrix-report.json")
    if d is None:
        return {"passed": False, "missing": ["matrix-report.json"]}
    verdict, attribution = d.get("verdict", {}), d.get("attribution", {})
    return {"passed": bool(verdict.get("passed")) and bool(attribution.get("conclusive")),
            "verdict": verdict, "attributed_modules": attribution.get("attributed_modules")}


def step_time_part(out: Path) -> dict[str, Any]:
    d = _load(out / "step_time.json")
    if d is None:
        return {"passed": False, "missing": ["step_time.json"]}
    medians = {engine: {case: v.get("median_seconds", {}).get(case) for case in ("R/R", "P/P")}
               for engine, v in d.get("by_rollout_engine", {}).items()}
    return {"passed": bool(medians) and all(all(m.values()) for m in medians.values()),
            "median_seconds": medians}


def summarise(out: Path, gpus: int) -> dict[str, Any]:
    want = EXPECTED[gpus]
    parts: dict[str, Any] = {name: run_part(out, name) for name in want["runs"]}
    for tp, cp in want["gates"]:
        parts[f"attention-gate-tp{tp}-cp{cp}"] = gate_part(out, gpus, tp, cp)
    parts["ipc-collectives"] = ipc_part(out)
    if want["matrix"]:
        parts["matrix"] = matrix_part(out)
    if want["step_time"]:
        parts["step-time"] = step_time_part(out)
    return {"schema_version": 1, "gpus": gpus, "parts": parts,
            "passed": all(p["passed"] for p in parts.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--gpus", type=int, required=True, choices=sorted(EXPECTED))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rl_engine.artifacts import files, provenance

    src = provenance.source()
    summary = {"commit": src["commit"], "dirty": src["dirty"], **summarise(args.folder, args.gpus)}
    files.write_json(args.out or args.folder / "summary.json", summary)
    for name, part in summary["parts"].items():
        print(f"{name:32} {'passed' if part['passed'] else 'FAILED'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
