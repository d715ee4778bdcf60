"""det_gemm's tile choice as this tree has it, judged on plan sweeps already recorded: no GPU needed.

benchmarks/det_gemm_plans.py times every plan det_gemm could run at each (shape, M) on one card.
This script compiles plan_det_gemm (include/rl_engine/cuda/det_gemm.cuh, host code) with nvcc,
asks it for its pick at each row of each sweep, with that sweep's SM count, and reads the pick's
ratio against cuBLAS from the sweep. It prints the rows whose pick changed and the det_gemm speed
targets met by the sweep's own picks, by this tree's and by the sweep's best plans (det_gemm_plans.py's:
the fastest, where it beats the pick by more than the timing noise), so that a change to
choose_gemm_tile can be weighed on every card swept before it runs on one.

    python benchmarks/det_gemm_replay.py SWEEP.json [SWEEP.json ...] [--out replay.json]

--out's JSON names this tree's commit and dirty flag (`source`) and each sweep's commit.
A ratio replayed this way is one measured at the sweep's commit: the kernels must be the same, and
only the choice among them may differ. Exit status 1 when this tree picks a plan a sweep never timed,
2 for input it cannot read (a file that is no sweep, a header that does not compile).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # rl_engine from this checkout: no install (and no torch) needed

from hopper_targets import det_gemm_verdicts  # noqa: E402
from provenance import source_state  # noqa: E402
from rl_engine.artifacts import files  # noqa: E402

ROW_KEYS = ("shape", "m", "n", "k", "pick", "pick_ratio", "best", "best_ratio", "plans")
PLAN_KEYS = ("plan", "bm", "bn", "swapped", "across")
PROGRAM = r"""
#include <cstdio>
#include "rl_engine/cuda/det_gemm.cuh"
int main() {
  int m, n, k, sms;
  while (std::scanf("%d %d %d %d", &m, &n, &k, &sms) == 4) {
    const rl_engine::cuda::GemmPlan p = rl_engine::cuda::plan_det_gemm(m, n, k, sms, true);
    std::printf("%d %d %d %d\n", p.tile.bm, p.tile.bn, p.tile.swap ? 1 : 0, p.split.across ? 1 : 0);
  }
  return 0;
}
"""


def fail(message: str):
    print(f"det_gemm_replay: {message}", file=sys.stderr)
    sys.exit(2)


def nvcc() -> str:
    found = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(found).exists():
        fail("needs nvcc (the tile choice is compiled from the CUDA header); put the CUDA toolkit's bin on PATH")
    return found


def tree_picks(queries: list[tuple[int, int, int, int]]) -> list[tuple[int, int, bool, bool]]:
    """plan_det_gemm(m, n, k, sms) of this tree for each query, as (bm, bn, swapped, across)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "picks.cu", Path(tmp) / "picks"
        src.write_text(PROGRAM)
        build = subprocess.run([nvcc(), "-O1", "-std=c++17", "--expt-relaxed-constexpr", "-I",
                                str(ROOT / "include"), "-o", str(exe), str(src)], capture_output=True, text=True)
        if build.returncode != 0:
            fail(f"the tile choice did not compile:\n{build.stderr[-3000:]}")
        feed = "".join(f"{m} {n} {k} {sms}\n" for m, n, k, sms in queries)
        out = subprocess.run([str(exe)], input=feed, capture_output=True, text=True, check=True).stdout
    picks = [(int(a), int(b), c == "1", d == "1") for a, b, c, d in (line.split() for line in out.splitlines())]
    if len(picks) != len(queries):
        fail(f"the tile choice answered {len(picks)} of {len(queries)} rows")
    return picks


def load(path: Path) -> dict:
    try:
        sweep = json.loads(path.read_text())
        rows, sms = sweep["rows"], int(sweep["sm_count"])
        for row in rows:
            missing = [key for key in ROW_KEYS if key not in row]
            lacking = next((key for plan in row.get("plans", []) for key in PLAN_KEYS if key not in plan), None)
            missing += [f"plans[].{lacking}"] if lacking else []
            if missing:
                raise ValueError(f"a row lacks {', '.join(missing)}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"{path} is not a det_gemm_plans.py result ({exc}); pass the JSON that "
             "benchmarks/det_gemm_plans.py --out wrote")
    if not rows:
        fail(f"{path} has no rows: rerun det_gemm_plans.py until at least one row is timed")
    return dict(sweep, rows=rows, sm_count=sms)


def verdicts(rows: list[dict], key: str) -> dict:
    return {name: f"{v['rows_met']} of {v['rows']}" for name, v in det_gemm_verdicts(rows, key).items()}


def replay(sweep: dict) -> dict:
    """Each row with the tree's pick and its ratio; the rows the tree picks an untimed plan for."""
    rows = sweep["rows"]
    picks = tree_picks([(r["m"], r["n"], r["k"], sweep["sm_count"]) for r in rows])
    out, untimed = [], []
    for row, (bm, bn, swapped, across) in zip(rows, picks):
        timed = {(p["bm"], p["bn"], p["swapped"], p["across"]): p for p in row["plans"]}
        plan = timed.get((bm, bn, swapped, across))
        if plan is None or "ratio" not in plan:
            untimed.append(f"{row['shape']} m={row['m']}: {bm}x{bn}{' swapped' if swapped else ''}"
                           f"{' across' if across else ''}")
            continue
        out.append(dict(shape=row["shape"], m=row["m"], sweep_pick=row["pick"], sweep_ratio=row["pick_ratio"],
                        tree_pick=plan["plan"], tree_ratio=plan["ratio"], best=row["best"],
                        best_ratio=row["best_ratio"]))
    return dict(device=sweep.get("device"), sm_count=sweep["sm_count"], commit=(sweep.get("source") or {}).get("commit"),
                rows=out, untimed=untimed,
                targets={basis: verdicts(out, f"{basis}_ratio") for basis in ("sweep", "tree", "best")})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", type=Path, help="det_gemm_plans.py results")
    ap.add_argument("--out", type=Path, help="also write the replay as JSON here")
    args = ap.parse_args()
    results = {}
    for path in args.sweeps:
        r = results[str(path)] = replay(load(path))
        print(f"{path}: {r['device']}, {r['sm_count']} SMs, swept at {r['commit']}")
        for row in r["rows"]:
            if row["tree_pick"] != row["sweep_pick"]:
                print(f"  {row['shape']:10s} m={row['m']:5d}  {row['sweep_pick']:22s} {row['sweep_ratio']:.3f} -> "
                      f"{row['tree_pick']:22s} {row['tree_ratio']:.3f}   (best {row['best']} {row['best_ratio']:.3f})")
        for basis, got in r["targets"].items():
            print(f"  {basis:5s} picks: decode-size rows >= 1.0: {got['det_gemm_ratio_decode_m']}; "
                  f"large-M rows >= 0.95: {got['det_gemm_ratio_large_m']}")
        for line in r["untimed"]:
            print(f"  not timed in this sweep: {line}", file=sys.stderr)
    if args.out:
        # source: the tree whose tile choice was replayed (each replay names its sweep's commit).
        files.write_json(args.out, dict(source=source_state(ROOT), replays=results))
    if any(r["untimed"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
