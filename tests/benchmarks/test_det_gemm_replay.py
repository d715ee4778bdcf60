"""benchmarks/det_gemm_replay.py: a recorded sweep replayed through this tree's tile choice (compiled
with nvcc, no GPU). Each test writes a small sweep whose plans carry made-up ratios, so what the
replay reads for a row is known: the ratio of the plan plan_det_gemm picks, and nothing else."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "det_gemm_replay.py"
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the tile choice is CUDA host code)")

# plan_det_gemm at 132 SMs: the square shape at M = 1 streams the weight on 32 x 8 swapped tiles, and
# at M = 8192 takes 128 x 256 (det_gemm.cuh's choose_gemm_tile; the CPU test of the plan choice
# holds every pick to the list the sweep times).
PLANS = [(32, 8, True, False), (128, 256, False, False), (128, 128, False, False)]


def plan(bm, bn, swapped, across, ratio):
    name = f"{bm}x{bn}" + (" swapped" if swapped else "") + (" across" if across else "")
    return dict(plan=name, bm=bm, bn=bn, swapped=swapped, across=across, bits_equal=True,
                r_ms=1.0 / ratio, p_ms=1.0, ratio=ratio)


def row(m, pick, ratios):
    plans = [plan(*p, ratios[p]) for p in PLANS]
    by = {p["plan"]: p for p in plans}
    best = max(plans, key=lambda p: p["ratio"])
    return dict(op="det_gemm", shape="square", m=m, n=4096, k=4096, pick=pick, pick_ratio=by[pick]["ratio"],
                best=best["plan"], best_ratio=best["ratio"], plans=plans)


def sweep(tmp_path, rows, name="sweep.json"):
    path = tmp_path / name
    path.write_text(json.dumps(dict(device="NVIDIA H100 80GB HBM3", sm_count=132,
                                    source=dict(commit="0" * 40, dirty=False), rows=rows)))
    return path


def run(*args):
    # The script finds rl_engine itself; nvcc's folder goes first on PATH, as a user's shell would have it.
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(NVCC).parent) if NVCC else "", os.environ.get("PATH", "")])}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env)


@needs_nvcc
def test_reads_the_ratio_of_the_plan_this_tree_picks(tmp_path):
    ratios = {PLANS[0]: 1.05, PLANS[1]: 0.40, PLANS[2]: 0.50}
    large = {PLANS[0]: 0.10, PLANS[1]: 0.96, PLANS[2]: 0.97}
    # The sweep says it picked something else at M = 1: the replay must report this tree's pick.
    path = sweep(tmp_path, [row(1, "128x128", ratios), row(8192, "128x256", large)])
    out = tmp_path / "replay.json"
    done = run(path, "--out", out)
    assert done.returncode == 0, done.stdout + done.stderr
    written = json.loads(out.read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert written["source"]["commit"] == (head.stdout.strip() if head.returncode == 0 else None)
    got = written["replays"][str(path)]
    one, big = got["rows"]
    assert (one["tree_pick"], one["tree_ratio"], one["sweep_ratio"]) == ("32x8 swapped", 1.05, 0.50)
    assert (big["tree_pick"], big["tree_ratio"]) == ("128x256", 0.96)
    assert got["targets"]["sweep"]["det_gemm_ratio_decode_m"] == "0 of 1"
    assert got["targets"]["tree"]["det_gemm_ratio_decode_m"] == "1 of 1"
    assert got["targets"]["tree"]["det_gemm_ratio_large_m"] == "1 of 1"
    assert "128x128" in done.stdout and "32x8 swapped" in done.stdout  # the changed row is printed


@needs_nvcc
def test_a_pick_the_sweep_never_timed_fails(tmp_path):
    r = row(8192, "128x256", {PLANS[0]: 0.1, PLANS[1]: 0.96, PLANS[2]: 0.97})
    r["plans"] = [p for p in r["plans"] if p["plan"] != "128x256"]
    done = run(sweep(tmp_path, [r]))
    assert done.returncode == 1
    assert "not timed in this sweep: square m=8192: 128x256" in done.stderr


def test_a_file_that_is_no_sweep_is_refused(tmp_path):
    bad = tmp_path / "hopper_ops.json"
    bad.write_text(json.dumps(dict(gemm=[])))
    done = run(bad)
    assert done.returncode == 2
    assert "is not a det_gemm_plans.py result" in done.stderr and "--out" in done.stderr


def test_a_row_without_its_plans_is_refused(tmp_path):
    r = row(1, "32x8 swapped", {PLANS[0]: 1.0, PLANS[1]: 0.5, PLANS[2]: 0.5})
    del r["plans"][1]["bn"]
    done = run(sweep(tmp_path, [r]))
    assert done.returncode == 2
    assert "a row lacks plans[].bn" in done.stderr


def test_a_missing_or_empty_sweep_is_refused(tmp_path):
    done = run(tmp_path / "nowhere.json")
    assert done.returncode == 2 and "is not a det_gemm_plans.py result" in done.stderr
    done = run(sweep(tmp_path, []))
    assert done.returncode == 2 and "has no rows" in done.stderr
