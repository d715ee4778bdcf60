"""benchmarks/multi_gpu_summary.py judges a multi-GPU evidence folder: a run passes only with a
bitwise, complete verdict and a passing trace check that launched all three IPC collectives; a
gate only with both transports passing and the replicas agreeing; a P/P Megatron run only when
every training readback names Megatron's DDP; anything missing, or written by another commit,
fails, so an empty or stale folder never passes."""

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


def test_ipc_needs_the_bitwise_check_and_every_gpu(tmp_path):
    verdict = {"meets_64MiB": True, "meets_small": True, "bitwise": True}
    write(tmp_path / "ipc_collectives.json", {"world": 4, "verdict": verdict})
    assert summary.ipc_part(tmp_path, 4)["passed"]
    assert not summary.ipc_part(tmp_path, 8)["passed"]
    write(tmp_path / "ipc_collectives.json", {"world": 4, "verdict": {**verdict, "bitwise": False}})
    assert not summary.ipc_part(tmp_path, 4)["passed"]


def test_replicas_that_disagree_or_say_nothing_fail_the_gate(tmp_path):
    for t, agree in (("cuda_ag_rs", False), ("p2p_reference", True)):
        write(tmp_path / "attention-gate" / f"attention-gate-cuda-w8-tp2-cp2-{t}-bf16.json",
              {"transport": t, "passed": True, "replicas_agree": agree})
    assert not summary.gate_part(tmp_path, 8, 2, 2)["passed"]
    write(tmp_path / "attention-gate" / "attention-gate-cuda-w8-tp2-cp2-cuda_ag_rs-bf16.json",
          {"transport": "cuda_ag_rs", "passed": True})
    assert not summary.gate_part(tmp_path, 8, 2, 2)["passed"]


def test_results_of_another_commit_are_stale(tmp_path):
    bitwise_run(tmp_path, "rr")
    write(tmp_path / "rr" / "manifest.json", {"source_commit": "aaa"})
    assert summary.run_part(tmp_path, "rr", "aaa")["passed"]
    part = summary.run_part(tmp_path, "rr", "bbb")
    assert not part["passed"] and part["stale"]
    gate(tmp_path, 4, 2, 2)
    for f in (tmp_path / "attention-gate").iterdir():
        write(f, {**json.loads(f.read_text()), "commit": "aaa"})
    assert summary.gate_part(tmp_path, 4, 2, 2, "aaa")["passed"]
    assert not summary.gate_part(tmp_path, 4, 2, 2, "bbb")["passed"]


def test_a_pp_megatron_run_needs_ddp_on_every_rank(tmp_path):
    run = tmp_path / "megatron-pp-small"
    (run).mkdir()
    (run / "exit-code").write_text("0\n")
    write(run / "readbacks" / "megatron-training-rank0.json",
          {"gradient_reduction": "production.megatron.ddp"})
    write(run / "readbacks" / "megatron-training-rank1.json",
          {"gradient_reduction": "production.all_reduce"})
    assert not summary.ddp_part(tmp_path, "megatron-pp-small")["passed"]
    write(run / "readbacks" / "megatron-training-rank1.json",
          {"gradient_reduction": "production.megatron.ddp"})
    part = summary.ddp_part(tmp_path, "megatron-pp-small")
    assert part["passed"] and part["ranks"] == 2
