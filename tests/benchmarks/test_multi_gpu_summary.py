"""benchmarks/multi_gpu_summary.py judges a multi-GPU evidence folder: a run passes only with a
bitwise, complete verdict and a passing trace check that launched all three IPC collectives; a
gate only with both transports passing; anything missing fails, so an empty folder never passes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("multi_gpu_summary",
                                              ROOT / "benchmarks" / "multi_gpu_summary.py")
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)

IPC = {"ipc_all_gather": 514, "ipc_all_reduce": 4194, "ipc_reduce_scatter": 96}


def write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def bitwise_run(out: Path, name: str, *, mismatches: int = 0, counts: dict = IPC) -> None:
    write(out / name / "bitwise-validation.json",
          {"passed": mismatches == 0, "mismatch_count": mismatches,
           "max_abs_diff": 0.0 if mismatches == 0 else 0.1, "fallbacks": [], "numel": 512})
    write(out / f"{name}-trace-gate.json", {"passed": True, "counts": counts, "problems": []})


def gate(out: Path, gpus: int, tp: int, cp: int, transports=("cuda_ag_rs", "p2p_reference"),
         passed: bool = True) -> None:
    for t in transports:
        write(out / "attention-gate" / f"attention-gate-cuda-w{gpus}-tp{tp}-cp{cp}-{t}-bf16.json",
              {"transport": t, "passed": passed, "replicas_agree": True})


def test_an_empty_folder_fails_every_part(tmp_path):
    result = summary.summarise(tmp_path, 8)
    assert not result["passed"]
    assert not any(p["passed"] for p in result["parts"].values())


def test_eight_gpus_pass_with_every_part_present(tmp_path):
    bitwise_run(tmp_path, "rr-medium-dp2")
    for tp, cp in ((1, 8), (2, 4), (2, 2)):
        gate(tmp_path, 8, tp, cp)
    write(tmp_path / "ipc_collectives.json",
          {"world": 8, "verdict": {"meets_64MiB": True, "meets_small": True, "bitwise": True}})
    result = summary.summarise(tmp_path, 8)
    assert result["passed"], result
    assert result["parts"]["rr-medium-dp2"]["ipc_launches"] == IPC


def test_a_run_without_reduce_scatter_or_with_a_mismatch_fails(tmp_path):
    bitwise_run(tmp_path, "no-rs", counts={**IPC, "ipc_reduce_scatter": 0})
    bitwise_run(tmp_path, "mismatch", mismatches=3)
    assert not summary.run_part(tmp_path, "no-rs")["passed"]
    assert not summary.run_part(tmp_path, "mismatch")["passed"]
    bitwise_run(tmp_path, "good")
    assert summary.run_part(tmp_path, "good")["passed"]


def test_a_gate_needs_both_transports_passing(tmp_path):
    gate(tmp_path, 4, 2, 2, transports=("cuda_ag_rs",))
    assert not summary.gate_part(tmp_path, 4, 2, 2)["passed"]
    gate(tmp_path, 4, 1, 4, passed=False)
    assert not summary.gate_part(tmp_path, 4, 1, 4)["passed"]
    gate(tmp_path, 4, 2, 2, transports=("p2p_reference",))
    assert summary.gate_part(tmp_path, 4, 2, 2)["passed"]


def test_ipc_needs_the_bitwise_check(tmp_path):
    write(tmp_path / "ipc_collectives.json",
          {"verdict": {"meets_64MiB": True, "meets_small": True, "bitwise": False}})
    assert not summary.ipc_part(tmp_path)["passed"]
