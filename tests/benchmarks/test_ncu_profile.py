"""benchmarks/ncu_profile.py reduces Nsight Compute's raw CSV page (a header of metric names, a row of
units, a row per profiled launch) to the last launch of each kernel with the figures that say what
bounds it; no table or no launch is an error, not an empty result."""

from __future__ import annotations

import csv
import importlib.util
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ncu_profile", ROOT / "benchmarks" / "ncu_profile.py")
ncu_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_profile)

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
          "gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
          "launch__registers_per_thread", STALL.format("barrier"), STALL.format("long_scoreboard"),
          STALL.format("wait")]
UNITS = ["", "", "", "", "", "", "", "ns", "%", "register/thread", "", "", ""]


def table(*launches: tuple) -> str:
    out = io.StringIO()
    out.write("==PROF== Connected to process 4242\n")  # ncu's own lines come first
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(HEADER)
    writer.writerow(UNITS)
    for i, (kernel, ns, dram, regs, stalls) in enumerate(launches):
        writer.writerow([i, 4242, "python3", "host", kernel, 1, 7, f"{ns:,}", dram, regs, *stalls])
    return out.getvalue()


def test_the_last_launch_of_each_kernel_is_kept_with_its_bounds():
    text = table(("rlk_gemm", 9000, 40.0, 168, (1.0, 2.0, 3.0)),
                 ("rlk_combine", 4100, 7.5, 32, (0.1, 9.0, "n/a")),
                 ("rlk_gemm", 8000, 61.5, 168, (0.5, 0.2, 1.25)))
    got = ncu_profile.summarize(text, "case")
    assert [k["kernel"] for k in got] == ["rlk_gemm", "rlk_combine"]
    gemm, combine = got
    assert gemm["duration_ns"] == 8000.0 and gemm["dram_pct"] == 61.5 and gemm["registers"] == 168.0
    assert list(gemm["top_stalls_cycles_per_issue"].items()) == [("wait", 1.25), ("barrier", 0.5),
                                                                   ("long_scoreboard", 0.2)]
    assert combine["top_stalls_cycles_per_issue"] == {"long_scoreboard": 9.0, "barrier": 0.1}


def test_a_table_without_launches_is_an_error():
    with pytest.raises(RuntimeError, match=r"profiled no kernel of case decode128 \(regex:rlk_\)"):
        ncu_profile.summarize(table(), "decode128")


def test_a_cublas_twin_profiles_every_kernel_and_the_rest_only_rl_engines():
    assert ncu_profile.kernel_filter("cublas_square_m8192") == "regex:."
    assert ncu_profile.kernel_filter("gemm_square_m8192") == "regex:rlk_"


def test_without_ncu_it_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["ncu_profile.py", "--out", str(tmp_path / "ncu.json")])
    with pytest.raises(SystemExit, match="no ncu on PATH or in \\$CUDA_HOME/bin"):
        ncu_profile.main()
    assert not (tmp_path / "ncu.json").exists()
