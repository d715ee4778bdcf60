"""Every plan det_gemm could run against cuBLAS, on one GPU: which tile, and which place for the K
ranges to meet, is fastest at each of benchmarks/hopper_ops.py's shapes and token counts.

det_gemm's tile choice (choose_gemm_tile in include/rl_engine/cuda/det_gemm.cuh) may look at M
because no tile changes a row's bits; the K ranges are fixed by N and K. This script times each
plan the kernel can run (the extension's _det_gemm_plans) as hopper_ops.py times det_gemm: a CUDA
graph cycling through copies of the weight that do not fit in L2 together, replayed alternately
with cuBLAS (F.linear), medians of CUDA-event timings. Each row records the plan det_gemm picks,
the best one (the highest ratio of cuBLAS's time to its own, where that beats the pick's by more
than the noise), both ratios, and under `targets` how many rows of each det_gemm speed target
(benchmarks/hopper_targets.py) the picks meet and how many the best plans would. Every plan's
output is compared with det_gemm's, bit for bit.

    python benchmarks/det_gemm_plans.py [--out results.json] [--repeats 10] [--shapes 4b_o,4b_kv]
                                        [--m 64,128,256]

The JSON is rewritten after each row (`complete` false until the last), so a run cut short keeps
what it timed. Exit status 3 when some plan gave other bits than det_gemm, 1 when one failed to run
(each named in the JSON and on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import rl_engine.ops  # noqa: F401  (loads the extension)
from hopper_ops import GEMM_M, GEMM_SHAPES, L2_BYTES, randn, time_graphs
from hopper_targets import det_gemm_verdicts
from provenance import add_source_args, source_of
from rl_engine.artifacts import files
from rl_engine.ops import _lib

RESULT = Path(__file__).resolve().parent / "results" / "det_gemm_plans.json"
# Besides hopper_ops.py's token counts, one inside each range where the tile choice changes between
# them (33-63, 65-127, 129-255): these rows are timed and named in the JSON but judged by no target.
EXTRA_M = (48, 96, 192)
# Another plan is called faster than the pick only where its ratio is higher by more than this
# share: two timings of one plan against cuBLAS differ by about that much from run to run.
NOISE = 0.02


def plan_name(plan) -> str:
    """[bm, bn, swapped, across] as '128x64', '64x16 swapped', '64x32 across'."""
    bm, bn, swapped, across = plan
    return f"{bm}x{bn}" + (" swapped" if swapped else "") + (" across" if across else "")


def plans_of(ops, x, w) -> list[list[int]]:
    flat = ops._det_gemm_plans(x, w)
    return [list(flat[i:i + 4]) for i in range(0, len(flat), 4)]


def best_of(plans: list[dict]) -> dict:
    """The plan to take: the pick (plans[0]) unless another that ran and gave det_gemm's bits has a
    ratio against cuBLAS higher by more than NOISE. Ratios, not times: each plan is timed beside its
    own cuBLAS replays, so a drift of the clocks between plans cancels."""
    pick = plans[0]
    fair = [p for p in plans if p.get("bits_equal") and "ratio" in p]
    if not fair:
        return pick
    best = max(fair, key=lambda p: p["ratio"])
    if "ratio" not in pick or not pick.get("bits_equal") or best["ratio"] > (1 + NOISE) * pick["ratio"]:
        return best
    return pick


def row_summary(shape: str, m: int, n: int, k: int, plans: list[dict]) -> dict:
    best = best_of(plans)
    pick = plans[0]
    return dict(op="det_gemm", shape=shape, m=m, n=n, k=k, pick=pick["plan"], pick_ratio=pick.get("ratio"),
                best=best["plan"], best_ratio=best.get("ratio"),
                speedup_of_best=pick["r_ms"] / best["r_ms"] if "r_ms" in pick and "r_ms" in best else None,
                bits_equal=all(p.get("bits_equal") is True for p in plans), plans=plans)


def targets(rows: list[dict]) -> dict:
    """The det_gemm ratio targets judged on the picks and on the fastest plans (rows at token counts
    no target names are left out, and so are rows with no ratio)."""
    return dict(pick=det_gemm_verdicts(rows, "pick_ratio"), best=det_gemm_verdicts(rows, "best_ratio"))


def time_plan(ops, plan, xm, ws, want, calls, repeats) -> dict:
    """One plan: its bits against det_gemm's, then its time beside cuBLAS's (an error is recorded,
    not raised, so that one plan that fails to launch leaves the others' figures)."""
    bm, bn, swapped, across = plan
    out = dict(plan=plan_name(plan), bm=bm, bn=bn, swapped=bool(swapped), across=bool(across))
    try:
        out["bits_equal"] = torch.equal(ops._det_gemm_on_plan(xm, ws[0], plan), want)
        r_ms, p_ms = time_graphs(
            [lambda w=ws[i % len(ws)]: ops._det_gemm_on_plan(xm, w, plan) for i in range(calls)],
            [lambda w=ws[i % len(ws)]: F.linear(xm, w) for i in range(calls)], repeats)
    except RuntimeError as exc:
        out["error"] = str(exc).splitlines()[0]
        return out
    out.update(r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms)
    return out


def sweep(ops, shapes, ms, repeats, emit) -> list[dict]:
    """Every plan of every (shape, M); emit(rows) after each row, so a run cut short keeps them."""
    rows = []
    for name, n, k in shapes:
        wbytes = n * k * 2
        ws = [randn(n, k, scale=0.02) for _ in range(min(24, max(2, -(-3 * L2_BYTES // wbytes))))]
        x = randn(max(ms), k)
        for m in ms:
            xm = x[:m]
            want = ops.det_gemm(xm, ws[0], None)
            calls = max(4, len(ws)) if m <= 1024 else 2
            timed = [time_plan(ops, plan, xm, ws, want, calls, repeats) for plan in plans_of(ops, xm, ws[0])]
            row = row_summary(name, m, n, k, timed)
            rows.append(row)
            emit(rows)
            failed = sum("error" in p for p in timed)
            ratio = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            print(f"{name:10s} m={m:5d} pick {row['pick']:20s} {ratio(row['pick_ratio'])}  best {row['best']:20s} "
                  f"{ratio(row['best_ratio'])}" + ("" if row["bits_equal"] else "  BITS DIFFER")
                  + (f"  {failed} FAILED" if failed else ""), flush=True)
        del ws, x
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(s[0] for s in GEMM_SHAPES),
                    help="which of hopper_ops.py's shapes, by name")
    ap.add_argument("--m", default=",".join(map(str, sorted({*GEMM_M, *EXTRA_M}))),
                    help="token counts (comma-separated)")
    add_source_args(ap)
    args = ap.parse_args()
    known = {s[0]: s for s in GEMM_SHAPES}
    unknown = [s for s in args.shapes.split(",") if s not in known]
    if unknown:
        sys.exit(f"det_gemm_plans: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    try:
        ms = sorted({int(m) for m in args.m.split(",")})
    except ValueError:
        sys.exit(f"det_gemm_plans: --m {args.m!r} is not a comma-separated list of token counts")
    if ms[0] < 1:
        sys.exit(f"det_gemm_plans: --m {args.m!r}: token counts start at 1")
    if args.repeats < 1:
        sys.exit(f"det_gemm_plans: --repeats {args.repeats}: time each plan at least once")
    if not torch.cuda.is_available():
        sys.exit("det_gemm_plans: needs a CUDA GPU (an sm_90a one, with the extension built for it)")
    ops = _lib.ops()
    if not ops.det_gemm_sm90_compiled():
        sys.exit("det_gemm_plans: this extension was built without its sm_90a kernels; build it on a "
                 "machine with nvcc (pip install -e .)")
    torch.manual_seed(0)
    x = randn(8192, 8192)
    for _ in range(200):  # ~1 s of matrix work first: clocks up before anything is timed
        x @ x
    del x
    source = source_of(args, Path(__file__).resolve().parent)
    head = dict(source=source, device=torch.cuda.get_device_name(),
                sm_count=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
                cuda=torch.version.cuda, build=json.loads(ops.build_info()),
                ratio="median cuBLAS time / median time of the plan (above 1: the plan is faster)", noise=NOISE)

    def emit(rows, complete=False):
        files.write_json(args.out, dict(head, complete=complete, rows=rows, targets=targets(rows)))

    rows = sweep(ops, [known[s] for s in args.shapes.split(",")], ms, args.repeats, emit)
    emit(rows, complete=True)
    for basis, verdicts in targets(rows).items():
        for name, v in verdicts.items():
            print(f"{basis:4s} {name} {v['target']:g}: {v['rows_met']} of {v['rows']} rows; worst {v['worst']}")
    failed = [f"{r['shape']} m={r['m']} {p['plan']}: {p['error']}" for r in rows for p in r["plans"] if "error" in p]
    bad = [f"{r['shape']} m={r['m']} {p['plan']}" for r in rows for p in r["plans"] if p.get("bits_equal") is False]
    if failed:
        print("det_gemm_plans: these plans failed: " + "; ".join(failed), file=sys.stderr)
    if bad:
        print(f"det_gemm_plans: these plans gave other bits than det_gemm: {'; '.join(bad)}", file=sys.stderr)
        sys.exit(3)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
