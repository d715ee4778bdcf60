"""benchmarks/det_gemm_plans.py: how a row names its plans, when another plan counts as faster than
det_gemm's pick, how the targets are judged on the picks and on the fastest plans, and the errors
it gives before it needs a GPU. The timing itself runs only on a GPU (the CUDA tests hold every plan
to det_gemm's bits: tests/ops/test_cuda_ops.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "det_gemm_plans.py"


@pytest.fixture
def plans(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("det_gemm_plans")


def timed(name, r_ms, p_ms=1.0, same=True):
    return dict(plan=name, r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms, bits_equal=same)


def test_plan_names(plans):
    assert plans.plan_name([128, 64, 0, 0]) == "128x64"
    assert plans.plan_name([64, 16, 1, 1]) == "64x16 swapped across"
    assert plans.plan_name([64, 32, 0, 1]) == "64x32 across"


def test_another_plan_is_best_only_when_its_ratio_beats_the_noise(plans):
    pick = timed("64x128", 1.00)
    assert plans.best_of([pick, timed("128x128", 0.99)]) is pick  # 1%: within the noise
    faster = timed("128x64", 0.90)
    assert plans.best_of([pick, timed("128x128", 0.99), faster]) is faster
    assert plans.best_of([timed("64x32", 1.0), timed("64x64", 1.5)])["plan"] == "64x32"
    # Ratios, not times: a plan timed while cuBLAS also ran slower is no faster.
    assert plans.best_of([pick, timed("128x64", 0.90, p_ms=0.90)]) is pick


def test_a_plan_with_other_bits_or_an_error_is_never_best(plans):
    pick = timed("64x128", 1.00)
    assert plans.best_of([pick, timed("128x64", 0.5, same=False)]) is pick
    assert plans.best_of([pick, dict(plan="128x32", bits_equal=True, error="launch failed")]) is pick
    broken = dict(plan="64x128", error="launch failed")
    other = timed("128x64", 1.2)
    assert plans.best_of([broken, other]) is other
    row = plans.row_summary("4b_kv", 8, 1024, 2560, [broken, other])
    assert (row["pick_ratio"], row["speedup_of_best"], row["bits_equal"]) == (None, None, False)
    assert plans.targets([row])["pick"]["det_gemm_ratio_decode_m"]["rows"] == 0


def test_rows_and_targets_judge_the_picks_and_the_fastest_plans(plans):
    rows = [
        plans.row_summary("4b_o", 128, 2560, 4096, [timed("64x128", 1.25), timed("128x64 across", 0.95)]),
        plans.row_summary("square", 16, 4096, 4096, [timed("64x16 swapped", 0.9)]),
        plans.row_summary("4b_o", 256, 2560, 4096, [timed("128x128 across", 1.4), timed("64x64", 1.2)]),
        plans.row_summary("square", 8192, 4096, 4096, [timed("128x256", 1.0, same=False), timed("128x192", 1.1)]),
    ]
    first = rows[0]
    assert (first["pick"], first["best"]) == ("64x128", "128x64 across")
    assert first["pick_ratio"] == pytest.approx(0.8) and first["best_ratio"] == pytest.approx(1 / 0.95)
    assert first["speedup_of_best"] == pytest.approx(1.25 / 0.95)
    assert first["bits_equal"] is True and rows[3]["bits_equal"] is False
    got = plans.targets(rows)
    decode, large = "det_gemm_ratio_decode_m", "det_gemm_ratio_large_m"
    assert (got["pick"][decode]["rows_met"], got["best"][decode]["rows_met"]) == (1, 2)
    assert got["pick"][decode]["worst"] == "4b_o m=128: 0.8"
    # The square pick meets 0.95 but gave other bits: the best plan there is the 128 x 192 one.
    assert (got["pick"][large]["rows_met"], got["best"][large]["rows_met"]) == (1, 0)
    assert rows[3]["best"] == "128x192"
    assert got["best"][large]["worst"] == "4b_o m=256: 0.8333"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_bad_arguments_are_named_before_any_gpu_work():
    got = run("--shapes", "square,nope")
    assert got.returncode != 0 and "unknown shape(s) nope; choose from square" in got.stderr
    got = run("--m", "0,16")
    assert got.returncode != 0 and "token counts start at 1" in got.stderr
    got = run("--m", "16,x")
    assert got.returncode != 0 and "is not a comma-separated list" in got.stderr
    got = run("--repeats", "0")
    assert got.returncode != 0 and "time each plan at least once" in got.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_machine_without_cuda_is_told_what_it_needs(tmp_path):
    out = tmp_path / "plans.json"
    got = run("--out", str(out))
    assert got.returncode != 0 and "needs a CUDA GPU" in got.stderr
    assert not out.exists()
